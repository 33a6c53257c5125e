// VmmPool: pointer-stable migration between device and host backing. The address never
// changes, the bytes follow, and every failure at the seam (no memory in the target, a
// map or copy that fails) leaves the data readable at the same address.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <future>
#include <string>
#include <utility>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/config.h"
#include "allocator/tags.h"
#include "tests/support/backend_errors.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;

class VmmMigrationTest : public tiering_test::TieringStreamTest {
 protected:
  void fill(void* ptr, const std::vector<unsigned char>& data) {
    backend().copy_async(ptr, data.data(), data.size(), CopyKind::host_to_device, stream_);
    backend().stream_synchronize(stream_);
  }
  long difference(const void* ptr, const std::vector<unsigned char>& data) {
    const auto seen = read_device(ptr, data.size(), stream_);
    return first_difference(seen.data(), data.data(), data.size());
  }
};

TEST_P(VmmMigrationTest, MigrationKeepsTheAddressAndTheBytes) {
  VmmPool pool(backend());
  const std::size_t n = 3 * backend().granularity() + 777;  // partial last granule
  void* p = pool.allocate(n, kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(pool.size_of(p), 4 * backend().granularity());
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), 4 * backend().granularity());
  const auto data = random_bytes(n, 11);
  fill(p, data);
  pool.record_use(p, stream_);
  pool.migrate(p, MemoryLocation::host);
  EXPECT_EQ(pool.base_of(static_cast<char*>(p) + 5), p);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), 4 * backend().granularity());
  EXPECT_EQ(difference(p, data), -1);
  if (on_host()) {  // the host backend's "device" memory is host-readable
    EXPECT_EQ(first_difference(static_cast<unsigned char*>(p), data.data(), n), -1);
  }
  pool.migrate(p, MemoryLocation::device);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), 4 * backend().granularity());
  EXPECT_EQ(difference(p, data), -1);
  const VmmStats s = pool.stats();
  EXPECT_EQ(s.bytes_to_host, 4 * backend().granularity());
  EXPECT_EQ(s.bytes_to_device, 4 * backend().granularity());
  pool.deallocate(p);
  EXPECT_EQ(pool.stats().ranges, 0u);
}

TEST_P(VmmMigrationTest, MigrationWaitsForTheStreamsThatUsedTheRange) {
  VmmPool pool(backend());
  const std::size_t n = backend().granularity();
  void* p = pool.allocate(n, kTagOptimizerState);
  const auto data = random_bytes(n, 12);
  // The write is held behind a gate on stream_: migrate() must wait for it, not copy the
  // range while the stream that uses it still has work queued.
  tiering_test::StreamGate gate;
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
  backend().launch_host_func(stream_, &tiering_test::StreamGate::wait, &gate);
  backend().copy_async(p, data.data(), n, CopyKind::host_to_device, stream_);
  pool.record_use(p, stream_);
  auto done = std::async(std::launch::async, [&] { pool.migrate(p, MemoryLocation::host); });
  // Not a timing bound: a migration that ends while the stream is held is the failure.
  EXPECT_EQ(done.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "migrate did not wait for the stream that used the range";
  gate.open();
  done.get();
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), n);
  EXPECT_EQ(difference(p, data), -1);
  pool.deallocate(p);
}

// PyTorch keeps using a block on its stream for the block's whole life without saying
// so again: the stream recorded once stays a user through every migration, and the
// deallocate waits for it too (a range unmapped under a queued kernel is a fault).
TEST_P(VmmMigrationTest, ARecordedStreamStaysAUserAfterItsFirstMigration) {
  VmmPool pool(backend());
  void* p = pool.allocate(backend().granularity(), kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  pool.record_use(p, stream_);
  pool.migrate(p, MemoryLocation::host);
  pool.migrate(p, MemoryLocation::device);
  const std::vector<std::pair<const char*, std::function<void()>>> operations = {
      {"migrate", [&] { pool.migrate(p, MemoryLocation::host); }},
      {"deallocate", [&] { pool.deallocate(p); }}};
  for (const auto& [name, operation] : operations) {
    tiering_test::StreamGate gate;
    const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
    backend().launch_host_func(stream_, &tiering_test::StreamGate::wait, &gate);
    auto done = std::async(std::launch::async, operation);
    // Not a timing bound: an operation that ends while the stream is held is the failure.
    EXPECT_EQ(done.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
        << name << " did not wait for the stream recorded before the first migration";
    gate.open();
    done.get();
  }
  EXPECT_EQ(pool.stats().ranges, 0u);
}

// A released stream is no longer waited for: a later migrate does not touch its handle.
TEST_P(VmmMigrationTest, AReleasedStreamIsNoLongerAUser) {
  VmmPool pool(backend());
  void* p = pool.allocate(backend().granularity(), kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  const Stream other = backend().create_stream();
  pool.record_use(p, other);
  pool.release_stream(other);
  backend().destroy_stream(other);
  EXPECT_NO_THROW(pool.migrate(p, MemoryLocation::host));
  EXPECT_NO_THROW(pool.deallocate(p));
}

TEST_P(VmmMigrationTest, TagMigrationMovesOnlyThatTag) {
  VmmPool pool(backend());
  void* a = pool.allocate(1000, kTagOptimizerState);
  void* b = pool.allocate(1000, TIDEPOOL_TAG_WORKSPACE);
  EXPECT_EQ(pool.migrate_tag(kTagOptimizerState, MemoryLocation::host).ranges, 1u);
  EXPECT_EQ(pool.bytes_in(a, MemoryLocation::host), backend().granularity());
  EXPECT_EQ(pool.bytes_in(b, MemoryLocation::device), backend().granularity());
  pool.deallocate(a);
  pool.deallocate(b);
}

// The out-of-memory push lists ranges, then moves them one by one with the lock let go
// between (each move waits for streams): a range freed meanwhile, whose address a new
// range of another tag may have taken, must not be moved as if it were the listed one.
TEST_P(VmmMigrationTest, AMoveOfAListedRangeSkipsARangeThatTookItsAddress) {
  VmmPool pool(backend());
  std::vector<std::uint64_t> ids;
  void* a = pool.allocate(1000, kTagOptimizerState);
  const std::vector<void*> listed = pool.device_backed_ranges(kTagOptimizerState, {}, &ids);
  ASSERT_EQ(listed, std::vector<void*>{a});
  ASSERT_EQ(ids, std::vector<std::uint64_t>{pool.range_id(a)});
  pool.deallocate(a);
  EXPECT_EQ(pool.migrate(a, MemoryLocation::host, ids[0]).ranges, 0u) << "freed: no error";
  // A new range, maybe at the same address: not the listed one, so not moved.
  void* b = pool.allocate(1000, TIDEPOOL_TAG_WORKSPACE);
  EXPECT_EQ(pool.migrate(b, MemoryLocation::host, ids[0]).ranges, 0u);
  EXPECT_EQ(pool.bytes_in(b, MemoryLocation::device), backend().granularity());
  // With its own id it moves.
  EXPECT_EQ(pool.migrate(b, MemoryLocation::host, pool.range_id(b)).ranges, 1u);
  EXPECT_EQ(pool.bytes_in(b, MemoryLocation::host), backend().granularity());
  pool.deallocate(b);
}

TEST_P(VmmMigrationTest, BadInputIsAClearError) {
  VmmPool pool(backend());
  EXPECT_THROW(pool.allocate(0, kTagOptimizerState), TieringError);
  int x = 0;
  EXPECT_THROW(pool.deallocate(&x), TieringError);
  EXPECT_THROW(pool.migrate(&x, MemoryLocation::host), TieringError);
  EXPECT_THROW(pool.record_use(&x, stream_), TieringError);
  void* p = pool.allocate(100, kTagOptimizerState);
  EXPECT_THROW(pool.deallocate(static_cast<char*>(p) + 64), TieringError);  // not the base
  EXPECT_FALSE(pool.owns(&x));
  EXPECT_TRUE(pool.owns(static_cast<char*>(p) + 64));
  // Ids for as many pointers as there is room: a mismatch names both and writes nothing.
  const void* asked[] = {p, &x};
  std::uint64_t ids[1] = {7};
  try {
    pool.range_ids(asked, ids);
    ADD_FAILURE() << "range_ids took 2 pointers with room for 1 id";
  } catch (const TieringError& e) {
    EXPECT_NE(std::string(e.what()).find("2 pointers but room for 1"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(ids[0], 7u);
  std::uint64_t both[2] = {};
  pool.range_ids(asked, both);
  EXPECT_EQ(both[0], pool.range_id(p));
  EXPECT_NE(both[0], 0u);
  EXPECT_EQ(both[1], 0u);
  pool.deallocate(p);
}

// Note [Nothing to move, nothing to wait for]: a range already where it is asked to go
// returns without waiting for its users (an eviction by tag reaches every optimizer's
// state, most of it evicted already); one that moves still waits.
TEST_P(VmmMigrationTest, AMigrationWithNothingToMoveDoesNotWaitForTheUsers) {
  VmmPool pool(backend());
  void* p = pool.allocate(backend().granularity(), kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  pool.record_use(p, stream_);
  tiering_test::StreamGate gate;
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
  backend().launch_host_func(stream_, &tiering_test::StreamGate::wait, &gate);
  // Generous: a wait would last until the gate opens, which is only after this.
  auto in_place =
      std::async(std::launch::async, [&] { return pool.migrate(p, MemoryLocation::device); });
  ASSERT_EQ(in_place.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "a migration that moves nothing waited for the stream";
  const MigrationResult r = in_place.get();
  EXPECT_EQ(r.ranges, 1u);
  EXPECT_EQ(r.bytes_moved, 0u);
  auto moves = std::async(std::launch::async, [&] { pool.migrate(p, MemoryLocation::host); });
  // Not a timing bound: a move that ends while the stream is held is the failure.
  EXPECT_EQ(moves.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  gate.open();
  moves.get();
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), backend().granularity());
  pool.deallocate(p);
}

// Review finding: a move to the device that the budget has no room for at all waited for
// the range's users first, then moved nothing (a prefetch under a full budget).
TEST_P(VmmMigrationTest, APrefetchTheBudgetHasNoRoomForDoesNotWaitForTheUsers) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = 0});
  void* p = pool.allocate(2 * g, kTagOptimizerState, MemoryLocation::host);
  ASSERT_NE(p, nullptr);
  pool.record_use(p, stream_);
  tiering_test::StreamGate gate;
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
  backend().launch_host_func(stream_, &tiering_test::StreamGate::wait, &gate);
  auto no_room =
      std::async(std::launch::async, [&] { return pool.migrate(p, MemoryLocation::device); });
  ASSERT_EQ(no_room.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "a prefetch that moves nothing waited for the stream";
  const MigrationResult r = no_room.get();
  EXPECT_EQ(r.bytes_moved, 0u);
  EXPECT_EQ(r.bytes_left, 2 * g);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), 2 * g);
  gate.open();
  pool.deallocate(p);
}

// ---- the device budget for state (Note [VMM device budget]) --------------------------------

// One optimizer's state named by pointer (tidepool_prefetch_ptrs): the ranges holding the
// pointers, in the order named, each once; pointers in no range are skipped.
TEST_P(VmmMigrationTest, MigratingTheRangesHoldingPointersGoesInTheirOrderEachOnce) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = 2 * g});
  std::vector<char*> r;
  for (int i = 0; i < 4; ++i) {
    r.push_back(static_cast<char*>(pool.allocate(g, kTagOptimizerState, MemoryLocation::host)));
    ASSERT_NE(r.back(), nullptr);
  }
  int elsewhere = 0;
  // r[2] named three times (at its base and inside it, as views are), then r[0], then
  // r[3], which the budget leaves on the host; r[1] is not named (another optimizer's).
  const void* ptrs[] = {r[2] + 100, nullptr, &elsewhere, r[2], r[2] + g - 1, r[0], r[3]};
  const MigrationResult m = pool.migrate_ranges_holding(ptrs, MemoryLocation::device);
  EXPECT_EQ(m.ranges, 3u);
  EXPECT_EQ(m.bytes_moved, 2 * g);
  EXPECT_EQ(m.bytes_left, g);
  EXPECT_EQ(pool.bytes_in(r[2], MemoryLocation::device), g);
  EXPECT_EQ(pool.bytes_in(r[0], MemoryLocation::device), g);
  EXPECT_EQ(pool.bytes_in(r[1], MemoryLocation::host), g);
  EXPECT_EQ(pool.bytes_in(r[3], MemoryLocation::host), g);
  EXPECT_EQ(pool.stats().budget_stops, 1u);
  EXPECT_EQ(pool.migrate_ranges_holding({}, MemoryLocation::device).ranges, 0u);
  for (char* p : r) pool.deallocate(p);
}


TEST_P(VmmMigrationTest, PrefetchStopsAtTheBudgetAndReportsWhatStayedOnTheHost) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = 3 * g});
  void* a = pool.allocate(2 * g, kTagOptimizerState);
  void* b = pool.allocate(2 * g, kTagOptimizerState);
  const auto data_a = random_bytes(2 * g, 21);
  const auto data_b = random_bytes(2 * g, 22);
  fill(a, data_a);
  fill(b, data_b);
  // Allocation is not limited by the budget (4 granules on the device now).
  EXPECT_EQ(pool.stats().device_backed_bytes, 4 * g);
  EXPECT_EQ(pool.migrate_tag(kTagOptimizerState, MemoryLocation::host).bytes_moved, 4 * g);

  // Ranges go in allocation order, whatever their addresses (mmap hands out addresses top
  // down, so b usually lies below a): a, allocated first, fits; b (one 2-granule chunk)
  // would exceed the budget and stays.
  void* fits = a;
  void* stays = b;
  const MigrationResult r = pool.migrate_tag(kTagOptimizerState, MemoryLocation::device);
  EXPECT_EQ(r.ranges, 2u);
  EXPECT_EQ(r.bytes_moved, 2 * g);
  EXPECT_EQ(r.bytes_left, 2 * g);
  EXPECT_EQ(pool.bytes_in(fits, MemoryLocation::device), 2 * g);
  EXPECT_EQ(pool.bytes_in(stays, MemoryLocation::host), 2 * g);
  EXPECT_LE(pool.stats().device_backed_bytes, 3 * g);
  EXPECT_EQ(difference(a, data_a), -1);
  EXPECT_EQ(difference(b, data_b), -1);  // readable on either side

  // By pointer too; once the other range leaves the device, it fits.
  EXPECT_EQ(pool.migrate(stays, MemoryLocation::device).bytes_left, 2 * g);
  pool.migrate(fits, MemoryLocation::host);
  const MigrationResult rb = pool.migrate(stays, MemoryLocation::device);
  EXPECT_EQ(rb.bytes_moved, 2 * g);
  EXPECT_EQ(rb.bytes_left, 0u);
  EXPECT_EQ(difference(a, data_a), -1);
  EXPECT_EQ(difference(b, data_b), -1);

  const VmmStats s = pool.stats();
  EXPECT_TRUE(s.has_device_budget);
  EXPECT_EQ(s.device_budget_bytes, 3 * g);
  EXPECT_EQ(s.budget_stops, 2u);
  EXPECT_EQ(s.bytes_left_on_host, 4 * g);
  pool.deallocate(a);
  pool.deallocate(b);
}

TEST_P(VmmMigrationTest, PrefetchFillsTheBudgetWithWhatFits) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = 3 * g});
  std::vector<void*> ranges;
  for (std::size_t granules : {2, 2, 1}) {
    ranges.push_back(pool.allocate(granules * g, kTagOptimizerState, MemoryLocation::host));
  }
  // In any address order, one 2-granule range stays and the other two fill the budget.
  const MigrationResult r = pool.migrate_tag(kTagOptimizerState, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 3 * g);
  EXPECT_EQ(r.bytes_left, 2 * g);
  EXPECT_EQ(pool.stats().device_backed_bytes, 3 * g);
  EXPECT_EQ(pool.bytes_in(ranges[2], MemoryLocation::device), g);
  for (void* p : ranges) pool.deallocate(p);
}

TEST_P(VmmMigrationTest, BudgetCanSplitARangeBetweenDeviceAndHost) {
  const std::size_t g = backend().granularity();
  const std::size_t n = (VmmPool::kChunkGranules + 4) * g;  // two chunks: 32 and 4 granules
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = (VmmPool::kChunkGranules + 1) * g});
  void* p = pool.allocate(n, kTagOptimizerState, MemoryLocation::host);
  // A cheap pattern (word index) rather than random bytes: 72 MiB under sanitizers.
  std::vector<unsigned char> data(n);
  for (std::size_t i = 0; i < n; i += sizeof(std::uint64_t)) {
    const std::uint64_t word = i * 0x9E3779B97F4A7C15ull;
    std::memcpy(data.data() + i, &word, sizeof word);
  }
  fill(p, data);
  const MigrationResult r = pool.migrate(p, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, VmmPool::kChunkGranules * g);
  EXPECT_EQ(r.bytes_left, 4 * g);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), VmmPool::kChunkGranules * g);
  EXPECT_EQ(pool.base_of(static_cast<char*>(p) + n - 1), p);
  // One pointer, two kinds of backing, the same bytes.
  EXPECT_TRUE(read_device(p, n, stream_) == data);
  pool.deallocate(p);
}

// BudgetCanSplitARangeBetweenDeviceAndHost in its steps, each a test of its own: on the
// H200 (2026-12-04) that test died of a segmentation fault with nothing printed, and these
// say which kind of copy did it. Each copy spans two chunks, that is two physical
// backings: both on the host (written and read), then one on the device and one on the
// host (Note [Copies across host-NUMA mappings] in cuda_backend.cpp).
class VmmSpanningCopyTest : public VmmMigrationTest {
 protected:
  // A range of two chunks (32 and 1 granules), on the host, and its word-index pattern
  // (cheap under sanitizers, unlike random bytes).
  void SetUp() override {
    VmmMigrationTest::SetUp();
    if (IsSkipped()) return;
    n_ = (VmmPool::kChunkGranules + 1) * backend().granularity();
    data_.resize(n_);
    for (std::size_t i = 0; i < n_; i += sizeof(std::uint64_t)) {
      const std::uint64_t word = i * 0x9E3779B97F4A7C15ull + 1;
      std::memcpy(data_.data() + i, &word, sizeof word);
    }
  }
  std::size_t n_ = 0;
  std::vector<unsigned char> data_;
};

TEST_P(VmmSpanningCopyTest, OneCopyWritesTwoHostBackedChunks) {
  VmmPool pool(backend());
  void* p = pool.allocate(n_, kTagOptimizerState, MemoryLocation::host);
  ASSERT_NE(p, nullptr);
  fill(p, data_);
  pool.migrate(p, MemoryLocation::device);  // copies chunk by chunk, never across
  EXPECT_EQ(difference(p, data_), -1);
  pool.deallocate(p);
}

TEST_P(VmmSpanningCopyTest, OneCopyReadsTwoHostBackedChunks) {
  VmmPool pool(backend());
  void* p = pool.allocate(n_, kTagOptimizerState, MemoryLocation::device);
  ASSERT_NE(p, nullptr);
  fill(p, data_);
  pool.migrate(p, MemoryLocation::host);
  EXPECT_EQ(difference(p, data_), -1);
  pool.deallocate(p);
}

TEST_P(VmmSpanningCopyTest, OneCopyReadsAndWritesADeviceAndAHostBackedChunk) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = VmmPool::kChunkGranules * g});
  void* p = pool.allocate(n_, kTagOptimizerState, MemoryLocation::device);
  ASSERT_NE(p, nullptr);
  pool.migrate(p, MemoryLocation::host);
  EXPECT_EQ(pool.migrate(p, MemoryLocation::device).bytes_left, g);  // the second chunk stays
  fill(p, data_);
  EXPECT_EQ(difference(p, data_), -1);
  pool.migrate(p, MemoryLocation::host);  // and the bytes written across both moved
  EXPECT_EQ(difference(p, data_), -1);
  pool.deallocate(p);
}

// Note [Migration batches]: a range of more chunks than one batch moves whole, each batch
// waited for once, its backings created by helper threads; moved back to the device and
// out again, it takes the spare host backings (Note [Spare host backings]) and creates no
// host memory.
TEST_P(VmmMigrationTest, ARangeOfSeveralBatchesMovesWholeAndReusesItsHostBackings) {
  const std::size_t g = backend().granularity();
  const std::size_t chunks = 5;  // of 2 granules, the last one of 1
  const std::size_t n = 9 * g;
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget,
                                         .batch_chunks = 2,
                                         .chunk_granules = 2});
  void* p = pool.allocate(n, kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  std::vector<unsigned char> data(n);
  for (std::size_t i = 0; i < n; i += sizeof(std::uint64_t)) {
    const std::uint64_t word = i * 0xD6E8FEB86659FD93ull + 7;
    std::memcpy(data.data() + i, &word, sizeof word);
  }
  fill(p, data);

  EXPECT_EQ(pool.migrate(p, MemoryLocation::host).bytes_moved, n);
  VmmStats s = pool.stats();
  EXPECT_EQ(s.migration_batches, 3u);
  EXPECT_EQ(s.backings_created, chunks);
  EXPECT_EQ(s.spare_host_reuses, 0u);
  EXPECT_EQ(s.migrations_to_host, chunks);
  EXPECT_GT(s.migration_backend_calls, 0u);
  EXPECT_EQ(difference(p, data), -1);

  EXPECT_EQ(pool.migrate(p, MemoryLocation::device).bytes_moved, n);
  s = pool.stats();
  EXPECT_EQ(s.spare_host_backings, chunks);  // every old host backing kept
  EXPECT_EQ(s.spare_host_bytes, n);
  EXPECT_EQ(difference(p, data), -1);

  const std::uint64_t created = s.backings_created;
  EXPECT_EQ(pool.migrate(p, MemoryLocation::host).bytes_moved, n);
  s = pool.stats();
  EXPECT_EQ(s.backings_created, created);  // no host memory created this time
  EXPECT_EQ(s.spare_host_reuses, chunks);
  EXPECT_EQ(s.spare_host_backings, 0u);
  EXPECT_EQ(s.migration_batches, 9u);  // three per move
  EXPECT_EQ(difference(p, data), -1);
  pool.deallocate(p);
}

// Note [Migration batches]: a tag's ranges of one chunk each, evicted together, have their
// host backings created ahead by helper threads; moved back and evicted again by pointer,
// they take the spares instead.
TEST_P(VmmMigrationTest, MovesOfManyRangesToTheHostCreateAheadOrTakeSpares) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget});
  std::vector<void*> ranges;
  std::vector<std::vector<unsigned char>> data;
  for (int i = 0; i < 6; ++i) {
    ranges.push_back(pool.allocate(g, kTagOptimizerState));
    ASSERT_NE(ranges.back(), nullptr);
    data.push_back(random_bytes(g, 60 + i));
    fill(ranges.back(), data.back());
  }
  EXPECT_EQ(pool.migrate_tag(kTagOptimizerState, MemoryLocation::host).bytes_moved, 6 * g);
  VmmStats s = pool.stats();
  EXPECT_EQ(s.backings_created, 6u);
  EXPECT_EQ(s.host_backed_bytes, 6 * g);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(difference(ranges[i], data[i]), -1) << i;

  EXPECT_EQ(pool.migrate_tag(kTagOptimizerState, MemoryLocation::device).bytes_moved, 6 * g);
  EXPECT_EQ(pool.stats().spare_host_backings, 6u);
  // Four of them by pointer (one named twice, inside it): the spares serve, none created.
  const void* ptrs[] = {ranges[4], ranges[1], static_cast<char*>(ranges[1]) + 5, ranges[0],
                        ranges[5]};
  const std::uint64_t created = pool.stats().backings_created;
  EXPECT_EQ(pool.migrate_ranges_holding(ptrs, MemoryLocation::host).bytes_moved, 4 * g);
  s = pool.stats();
  EXPECT_EQ(s.backings_created, created + 0);
  EXPECT_EQ(s.spare_host_reuses, 4u);
  EXPECT_LE(s.spare_host_bytes, s.device_backed_bytes);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(difference(ranges[i], data[i]), -1) << i;
  for (void* p : ranges) pool.deallocate(p);
  EXPECT_EQ(pool.stats().spare_host_backings, 0u);
}

// Note [Spare host backings]: never more than the pool's device-backed bytes, none with
// spare_host_bytes 0, and given back on request.
TEST_P(VmmMigrationTest, SpareHostBackingsAreBoundedAndCanBeGivenBack) {
  const std::size_t g = backend().granularity();
  {
    VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget,
                                           .spare_host_bytes = 0});
    void* p = pool.allocate(2 * g, kTagOptimizerState, MemoryLocation::host);
    pool.migrate(p, MemoryLocation::device);
    EXPECT_EQ(pool.stats().spare_host_backings, 0u);
    pool.deallocate(p);
  }
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget});
  void* a = pool.allocate(2 * g, kTagOptimizerState, MemoryLocation::host);
  void* b = pool.allocate(g, kTagOptimizerState, MemoryLocation::host);
  pool.migrate(a, MemoryLocation::device);
  pool.migrate(b, MemoryLocation::device);
  EXPECT_EQ(pool.stats().spare_host_bytes, 3 * g);
  pool.deallocate(a);  // 1 granule left on the device: the 2-granule spare is of no use
  VmmStats s = pool.stats();
  EXPECT_LE(s.spare_host_bytes, s.device_backed_bytes);
  EXPECT_EQ(s.spare_host_bytes, g);
  // An allocation on the host takes a spare of its size.
  void* c = pool.allocate(g, kTagOptimizerState, MemoryLocation::host);
  EXPECT_EQ(pool.stats().spare_host_backings, 0u);
  pool.migrate(c, MemoryLocation::device);
  EXPECT_EQ(pool.stats().spare_host_backings, 1u);
  pool.release_spare_host_backings();
  s = pool.stats();
  EXPECT_EQ(s.spare_host_backings, 0u);
  EXPECT_EQ(s.spare_host_bytes, 0u);
  EXPECT_EQ(s.deferred_releases, 0u);
  pool.deallocate(b);
  pool.deallocate(c);
}

TEST_P(VmmMigrationTest, WithoutABudgetEverythingMoves) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend(), VmmPoolOptions{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget});
  void* p = pool.allocate(5 * g, kTagOptimizerState, MemoryLocation::host);
  const MigrationResult r = pool.migrate_tag(kTagOptimizerState, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 5 * g);
  EXPECT_EQ(r.bytes_left, 0u);
  EXPECT_FALSE(pool.stats().has_device_budget);
  pool.deallocate(p);
}

// The default budget is tidepool.state_budget, read at each migration.
class VmmBudgetConfigTest : public VmmMigrationTest {
 protected:
  void TearDown() override {
    apply_config(Config{});
    VmmMigrationTest::TearDown();
  }
};

TEST_P(VmmBudgetConfigTest, StateBudgetFromTheConfigurationLimitsPrefetch) {
  const std::size_t g = backend().granularity();
  VmmPool pool(backend());
  void* a = pool.allocate(2 * g, kTagOptimizerState, MemoryLocation::host);
  void* b = pool.allocate(2 * g, kTagOptimizerState, MemoryLocation::host);
  EXPECT_FALSE(pool.device_budget_bytes().has_value());  // tidepool not configured

  apply_config(claim_config("tidepool.state_budget:0").config);
  EXPECT_EQ(pool.device_budget_bytes(), std::optional<std::size_t>(0));
  MigrationResult r = pool.migrate_tag(kTagOptimizerState, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 0u);  // 0: the state stays on the host, reached in place
  EXPECT_EQ(r.bytes_left, 4 * g);

  apply_config(claim_config("tidepool.state_budget:" + std::to_string(3 * g)).config);
  r = pool.migrate_tag(kTagOptimizerState, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 2 * g);
  EXPECT_EQ(r.bytes_left, 2 * g);
  EXPECT_EQ(pool.bytes_in(a, MemoryLocation::device) + pool.bytes_in(b, MemoryLocation::device),
            2 * g);  // one of the two ranges
  EXPECT_EQ(pool.stats().device_backed_bytes, 2 * g);
  pool.deallocate(a);
  pool.deallocate(b);
}

// ---- fault injection (host backend) ------------------------------------------------------

class VmmMigrationFaultTest : public VmmMigrationTest {};

TEST_P(VmmMigrationFaultTest, EveryFailedStepKeepsTheDataAtTheSameAddress) {
  VmmPool pool(backend());
  const std::size_t n = 2 * backend().granularity();
  void* p = pool.allocate(n, kTagOptimizerState);
  const auto data = random_bytes(n, 13);
  fill(p, data);
  // The map of the new backing fails (the seam's injection hits the next map).
  backend().inject_fault(FaultPoint::map, 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), n);
  EXPECT_EQ(difference(p, data), -1);

  backend().inject_fault(FaultPoint::create_physical, 1);
  const std::string m =
      test_support::expect_error<TieringError>([&] { pool.migrate(p, MemoryLocation::host); });
  EXPECT_NE(m.find("out of host memory"), std::string::npos) << m;
  EXPECT_EQ(difference(p, data), -1);

  backend().inject_fault(FaultPoint::copy, 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), n);
  EXPECT_EQ(difference(p, data), -1);

  EXPECT_EQ(pool.stats().failed_migrations, 3u);
  pool.migrate(p, MemoryLocation::host);  // the faults are spent
  EXPECT_EQ(difference(p, data), -1);
  pool.deallocate(p);
}

TEST_P(VmmMigrationFaultTest, OutOfDeviceMemoryOnAllocateIsNull) {
  VmmPool pool(backend());
  backend().inject_fault(FaultPoint::create_physical, 1);
  EXPECT_EQ(pool.allocate(1000, kTagOptimizerState), nullptr);
  EXPECT_EQ(pool.stats().ranges, 0u);
  void* p = pool.allocate(1000, kTagOptimizerState);
  EXPECT_NE(p, nullptr);
  pool.deallocate(p);
}

INSTANTIATE_TEST_SUITE_P(Backends, VmmMigrationTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);
INSTANTIATE_TEST_SUITE_P(Backends, VmmBudgetConfigTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);
INSTANTIATE_TEST_SUITE_P(Backends, VmmSpanningCopyTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);
#ifndef TIDEPOOL_TIERING_GPU_BUILD  // fault injection exists on the host backend only
INSTANTIATE_TEST_SUITE_P(Host, VmmMigrationFaultTest, ::testing::Values(BackendKind::host),
                         tiering_test::backend_name);
#else
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(VmmMigrationFaultTest);
#endif

}  // namespace
}  // namespace tidepool
