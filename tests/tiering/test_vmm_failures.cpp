// VmmPool when backend calls fail in the middle of a migration, an allocation or a free:
// every physical handle is released exactly once, at once or, when its release fails, at
// a later call (Note [Deferred releases] in vmm_backings.cpp); the pool stays usable;
// and the data stays intact at the same address. Host backend only: the failures are
// chosen calls of a wrapper around it (failing_backend.h), which also counts the live
// physical handles, so a leaked handle or one released twice shows.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <future>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "allocator/forwarding_backend.h"
#include "allocator/tags.h"
#include "tests/support/backend_errors.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"  // TieringError
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::FailingBackend;
using tiering_test::first_difference;
using tiering_test::random_bytes;

// The pool runs on backend_; the test's own copies go to the host backend under it, so
// a failure chosen for the pool never hits them.
class VmmFailureTest : public ::testing::Test {
 protected:
  VmmFailureTest() : inner_(make_host_backend(0)), backend_(*inner_) {
    stream_ = inner_->create_stream();
  }
  ~VmmFailureTest() override { inner_->destroy_stream(stream_); }

  void fill(void* ptr, const std::vector<unsigned char>& data) {
    inner_->copy_async(ptr, data.data(), data.size(), CopyKind::host_to_device, stream_);
    inner_->stream_synchronize(stream_);
  }
  long difference(const void* ptr, const std::vector<unsigned char>& data) {
    std::vector<unsigned char> seen(data.size());
    inner_->copy_async(seen.data(), ptr, seen.size(), CopyKind::device_to_host, stream_);
    inner_->stream_synchronize(stream_);
    return first_difference(seen.data(), data.data(), data.size());
  }
  // Runs `operation`, which may fail only with a TieringError; returns its message ("" if
  // it succeeded).
  template <typename Operation>
  std::string failure_of(Operation&& operation, const std::string& what) {
    try {
      operation();
    } catch (const TieringError& e) {
      return e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << what << ": not a TieringError: " << e.what();
      return e.what();
    }
    return "";
  }

  // A new range of `bytes` in `pool`, filled with random bytes from `seed`. When the
  // allocation fails, `ptr` is null and nothing is written.
  struct FilledRange {
    void* ptr;
    std::size_t bytes;
    std::vector<unsigned char> data;
  };
  FilledRange allocate_filled(VmmPool& pool, std::size_t bytes, std::uint64_t seed) {
    FilledRange range{pool.allocate(bytes, kTagOptimizerState), bytes, random_bytes(bytes, seed)};
    if (range.ptr != nullptr) fill(range.ptr, range.data);
    return range;
  }
  // A new stream of the host backend recorded as a user of `ptr`, for the lost-stream tests
  // to destroy without release_stream (Note [A lost use stream]).
  Stream new_user_stream(VmmPool& pool, const void* ptr) {
    const Stream stream = inner_->create_stream();
    pool.record_use(ptr, stream);
    return stream;
  }

  std::unique_ptr<Backend> inner_;
  FailingBackend backend_;
  Stream stream_;
};

// Each backend call a migration to the host makes fails in turn (once, or twice in a row:
// a failed map and the map that puts the old backing back). Whatever failed, the bytes
// are at the same address (at once, or after the next call when neither backing could be
// mapped there), the next migration completes, and exactly the range's one backing is
// alive: none leaked, none released twice.
// Review finding: a pool whose event or scratch reservation failed as it was made leaked
// the stream (and event) it had made already: no destructor runs for a failed constructor.
TEST_F(VmmFailureTest, APoolThatCannotBeMadeLeavesNoStreamOrEventBehind) {
  for (const char* op : {"create_event", "reserve_address"}) {
    SCOPED_TRACE(op);
    const long streams = backend_.calls_to("destroy_stream") - backend_.calls_to("create_stream");
    const long events = backend_.calls_to("destroy_event") - backend_.calls_to("create_event");
    backend_.fail_calls_to(op, 1);
    EXPECT_THROW(VmmPool pool(backend_), BackendError);
    EXPECT_EQ(backend_.calls_to("destroy_stream") - backend_.calls_to("create_stream"), streams);
    // A failed create_event made none: counted as made, it is not destroyed.
    const long failed_event = std::string(op) == "create_event" ? 1 : 0;
    EXPECT_EQ(backend_.calls_to("destroy_event") - backend_.calls_to("create_event"),
              events - failed_event);
  }
}

TEST_F(VmmFailureTest, EveryFailedCallOfAMigrationLeavesTheDataAndNoHandleBehind) {
  const std::size_t n = 2 * backend_.granularity();  // one chunk
  const auto data = random_bytes(n, 41);
  for (const char* op : {"create_physical", "map", "copy_async", "stream_synchronize", "unmap",
                         "release_physical"}) {
    for (int count : {1, 2}) {
      for (int skip = 0;; ++skip) {
        const std::string where = std::string(op) + " x" + std::to_string(count) + " after " +
                                  std::to_string(skip);
        VmmPool pool(backend_);
        void* p = pool.allocate(n, kTagOptimizerState);
        ASSERT_NE(p, nullptr) << where;
        fill(p, data);
        const long failed_before = backend_.failed_calls();
        backend_.fail_calls_to(op, count, skip);
        const std::string failure =
            failure_of([&] { pool.migrate(p, MemoryLocation::host); }, where);
        backend_.fail_calls_to(op, 0);
        const bool any_failed = backend_.failed_calls() > failed_before;
        if (!failure.empty()) {
          EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), n) << where << ": " << failure;
          if (failure.find("at the next call") == std::string::npos) {
            EXPECT_EQ(difference(p, data), -1) << where << ": " << failure;
          }
        } else {  // a failed release is not the migration's failure
          EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), n) << where;
          EXPECT_EQ(difference(p, data), -1) << where;
        }

        EXPECT_EQ(failure_of([&] { pool.migrate(p, MemoryLocation::host); }, where), "") << where;
        EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), n) << where;
        EXPECT_EQ(difference(p, data), -1) << where;
        EXPECT_EQ(pool.stats().deferred_releases, 0u) << where;
        EXPECT_EQ(backend_.live_physicals(), 1u) << where;
        EXPECT_EQ(failure_of([&] { pool.deallocate(p); }, where), "") << where;
        EXPECT_EQ(backend_.live_physicals(), 0u) << where;
        if (!any_failed) break;  // `skip` passed the op's last call in a migration
      }
    }
  }
}

// Review finding: when a failed move's stream could not be synchronized (nor again when the
// move gave up), its copies may still read the range; deallocate released the range's
// backings all the same. It refuses while that stream cannot be synchronized, the range
// and its bytes stay, and once the stream can be, the range goes and nothing is left.
TEST_F(VmmFailureTest, ARangeAFailedMoveMayStillReadIsNotFreedUntilItsStreamIsDone) {
  const std::size_t n = 2 * backend_.granularity();
  const auto data = random_bytes(n, 43);
  VmmPool pool(backend_);
  void* p = pool.allocate(n, kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  fill(p, data);
  // The batch's wait, the wait when the move gives up, and deallocate's retry.
  backend_.fail_calls_to("stream_synchronize", 3);
  EXPECT_NE(failure_of([&] { pool.migrate(p, MemoryLocation::host); }, "migrate"), "");
  EXPECT_NE(failure_of([&] { pool.deallocate(p); }, "deallocate").find("stays allocated"),
            std::string::npos);
  backend_.fail_calls_to("stream_synchronize", 0);
  EXPECT_EQ(pool.stats().ranges, 1u);
  EXPECT_EQ(difference(p, data), -1);
  EXPECT_EQ(failure_of([&] { pool.deallocate(p); }, "deallocate"), "");
  EXPECT_EQ(pool.stats().ranges, 0u);
  EXPECT_EQ(backend_.live_physicals(), 0u);
}

// The same for a range of three chunks moved two at a time, their new backings made by
// helper threads (Note [Migration batches] in vmm_moves.cpp), in both directions, and to
// the host again taking the spare host backings the move to the device kept (Note [Spare
// host backings]). Whatever call fails: every byte at its address (at once, or after the
// next call), the chunks swapped before the failure moved and the others stayed, the next
// move completes, and each live handle is the range's or a spare: none leaked, none
// released twice. A failed release is no failure of the move.
TEST_F(VmmFailureTest, EveryFailedCallOfABatchedMoveLeavesTheDataAndNoHandleBehind) {
  const std::size_t g = backend_.granularity();
  const std::size_t n = 5 * g;  // chunks of 2, 2 and 1 granules
  const VmmPoolOptions options{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget,
                               .batch_chunks = 2,
                               .chunk_granules = 2};
  const auto data = random_bytes(n, 45);
  enum class Move { to_host, to_device, to_host_again };
  for (const Move move : {Move::to_host, Move::to_device, Move::to_host_again}) {
    const MemoryLocation to = move == Move::to_device ? MemoryLocation::device
                                                      : MemoryLocation::host;
    for (const char* op : {"create_physical", "map", "copy_async", "stream_synchronize",
                           "unmap", "release_physical"}) {
      for (int skip = 0;; ++skip) {
        const std::string where = std::string(op) + " after " + std::to_string(skip) +
                                  (move == Move::to_host        ? " to the host"
                                   : move == Move::to_device    ? " to the device"
                                                                : " to the host again");
        VmmPool pool(backend_, options);
        void* p = pool.allocate(n, kTagOptimizerState,
                                move == Move::to_device ? MemoryLocation::host
                                                        : MemoryLocation::device);
        ASSERT_NE(p, nullptr) << where;
        fill(p, data);
        if (move == Move::to_host_again) {
          pool.migrate(p, MemoryLocation::host);
          pool.migrate(p, MemoryLocation::device);
          ASSERT_EQ(pool.stats().spare_host_backings, 3u) << where;
        }
        const long failed_before = backend_.failed_calls();
        backend_.fail_calls_to(op, 1, skip);
        const std::string failure = failure_of([&] { pool.migrate(p, to); }, where);
        backend_.fail_calls_to(op, 0);
        const bool any_failed = backend_.failed_calls() > failed_before;
        const MemoryLocation from = to == MemoryLocation::host ? MemoryLocation::device
                                                               : MemoryLocation::host;
        EXPECT_EQ(pool.bytes_in(p, to) + pool.bytes_in(p, from), n) << where;
        if (failure.empty()) {
          EXPECT_EQ(pool.bytes_in(p, to), n) << where;
        } else if (failure.find("at the next call") == std::string::npos) {
          EXPECT_EQ(difference(p, data), -1) << where << ": " << failure;
        }
        EXPECT_EQ(failure_of([&] { pool.migrate(p, to); }, where), "") << where;
        EXPECT_EQ(pool.bytes_in(p, to), n) << where;
        EXPECT_EQ(difference(p, data), -1) << where;
        const VmmStats s = pool.stats();
        EXPECT_EQ(s.deferred_releases, 0u) << where;
        EXPECT_LE(s.spare_host_bytes, s.device_backed_bytes) << where;
        EXPECT_EQ(backend_.live_physicals(), 3u + s.spare_host_backings) << where;
        EXPECT_EQ(failure_of([&] { pool.deallocate(p); }, where), "") << where;
        EXPECT_EQ(backend_.live_physicals(), 0u) << where;
        if (!any_failed) break;  // `skip` passed the op's last call in the move
      }
    }
  }
}

// An eviction by tag whose host backings are created ahead by helper threads (Note
// [Migration batches] in vmm_moves.cpp), with one creation failing: the call stops at the
// range whose backing failed, each range is wholly on one side with its bytes, and what
// was created for ranges not reached is handed back (kept as a spare or released), so
// every live handle is a range's or a spare.
TEST_F(VmmFailureTest, AFailedCreationInAnEvictionByTagLeavesEveryRangeWholeAndNoHandleBehind) {
  const std::size_t g = backend_.granularity();
  for (int skip = 0; skip < 4; ++skip) {
    const std::string where = "create_physical after " + std::to_string(skip);
    VmmPool pool(backend_, VmmPoolOptions{.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget});
    std::vector<void*> ranges;
    std::vector<std::vector<unsigned char>> data;
    for (int i = 0; i < 4; ++i) {
      ranges.push_back(pool.allocate(g, kTagOptimizerState));
      ASSERT_NE(ranges.back(), nullptr) << where;
      data.push_back(random_bytes(g, 70 + i));
      fill(ranges.back(), data.back());
    }
    backend_.fail_calls_to("create_physical", 1, skip);
    const std::string failure = failure_of(
        [&] { pool.migrate_tag(kTagOptimizerState, MemoryLocation::host); }, where);
    backend_.fail_calls_to("create_physical", 0);
    EXPECT_NE(failure, "") << where;
    EXPECT_EQ(pool.stats().failed_migrations, 1u) << where;
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(pool.bytes_in(ranges[i], MemoryLocation::host) +
                    pool.bytes_in(ranges[i], MemoryLocation::device),
                g)
          << where << " range " << i;
      EXPECT_EQ(difference(ranges[i], data[i]), -1) << where << " range " << i;
    }
    VmmStats s = pool.stats();
    EXPECT_LE(s.spare_host_bytes, s.device_backed_bytes) << where;
    EXPECT_EQ(backend_.live_physicals(), 4u + s.spare_host_backings) << where;
    EXPECT_EQ(failure_of([&] { pool.migrate_tag(kTagOptimizerState, MemoryLocation::host); },
                         where),
              "")
        << where;
    s = pool.stats();
    EXPECT_EQ(s.host_backed_bytes, 4 * g) << where;
    EXPECT_EQ(s.deferred_releases, 0u) << where;
    EXPECT_EQ(backend_.live_physicals(), 4u + s.spare_host_backings) << where;
    for (int i = 0; i < 4; ++i) EXPECT_EQ(difference(ranges[i], data[i]), -1) << where;
    for (void* p : ranges) pool.deallocate(p);
    EXPECT_EQ(backend_.live_physicals(), 0u) << where;
  }
}

// A release that keeps failing stays deferred: the retries at later calls do not lose the
// handle, and the pool's destruction releases it at last.
TEST_F(VmmFailureTest, AReleaseThatFailsAgainIsRetriedUntilTheTeardown) {
  {
    VmmPool pool(backend_);
    const auto [p, n, data] = allocate_filled(pool, 2 * backend_.granularity(), 42);
    backend_.fail_calls_to("release_physical", 2);  // the old backing's, then the retry
    pool.migrate(p, MemoryLocation::host);
    VmmStats s = pool.stats();
    EXPECT_EQ(s.deferred_releases, 1u);
    EXPECT_EQ(s.deferred_release_bytes, n);
    EXPECT_EQ(s.host_backed_bytes, n);
    EXPECT_EQ(s.device_backed_bytes, 0u);
    EXPECT_EQ(backend_.live_physicals(), 2u);

    pool.migrate(p, MemoryLocation::device);  // the retry fails again; the move does not
    EXPECT_EQ(pool.stats().deferred_releases, 1u);
    EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), n);
    EXPECT_EQ(difference(p, data), -1);
    // The old host backing is kept as a spare (Note [Spare host backings]).
    EXPECT_EQ(pool.stats().spare_host_backings, 1u);
    EXPECT_EQ(backend_.live_physicals(), 3u);

    backend_.fail_calls_to("release_physical", 1, 1);  // the range's own release fails
    // Retries the deferred one first, then defers the range's; with no device-backed bytes
    // left, the spare is of no use and is released.
    pool.deallocate(p);
    EXPECT_FALSE(pool.owns(p));
    EXPECT_EQ(pool.stats().spare_host_backings, 0u);
    EXPECT_EQ(pool.stats().ranges, 0u);
    EXPECT_EQ(pool.stats().deferred_releases, 1u);
    EXPECT_EQ(backend_.live_physicals(), 1u);
  }
  EXPECT_EQ(backend_.live_physicals(), 0u);  // released by the destructor
}

// A failed copy whose scratch unmap fails too: the scratch range is unmapped at the next
// call, so the pool can still migrate (it maps every new backing there first).
TEST_F(VmmFailureTest, AScratchRangeLeftMappedIsUnmappedAtTheNextCall) {
  VmmPool pool(backend_);
  const auto [p, n, data] = allocate_filled(pool, 2 * backend_.granularity(), 43);
  backend_.fail_calls_to("copy_async", 1);
  backend_.fail_calls_to("unmap", 1);
  backend_.fail_calls_to("release_physical", 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.stats().deferred_releases, 1u);
  EXPECT_EQ(difference(p, data), -1);
  for (MemoryLocation to : {MemoryLocation::host, MemoryLocation::device}) {
    EXPECT_NO_THROW(pool.migrate(p, to));
    EXPECT_EQ(pool.bytes_in(p, to), n);
    EXPECT_EQ(difference(p, data), -1);
  }
  EXPECT_EQ(pool.stats().deferred_releases, 0u);
  EXPECT_EQ(pool.stats().spare_host_backings, 1u);  // Note [Spare host backings]
  EXPECT_EQ(backend_.live_physicals(), 2u);         // the range's and the spare
  pool.deallocate(p);
  EXPECT_EQ(backend_.live_physicals(), 0u);
}

// Each call a deallocate makes fails in turn: the range is freed (at once, or by the
// deallocate called again after a failed unmap), and every backing is released once the
// next call has retried what failed.
TEST_F(VmmFailureTest, AFailedDeallocateCanBeRetriedAndLeaksNothing) {
  const std::size_t g = backend_.granularity();
  const std::size_t n = (VmmPool::kChunkGranules + 2) * g;  // two chunks
  for (const char* op : {"unmap", "release_physical", "release_address"}) {
    for (int skip = 0;; ++skip) {
      const std::string where = std::string(op) + " after " + std::to_string(skip);
      VmmPool pool(backend_);
      void* p = pool.allocate(n, kTagOptimizerState);
      void* other = pool.allocate(g, kTagOptimizerState);
      ASSERT_TRUE(p && other) << where;
      const long failed_before = backend_.failed_calls();
      backend_.fail_calls_to(op, 1, skip);
      const std::string failure = failure_of([&] { pool.deallocate(p); }, where);
      backend_.fail_calls_to(op, 0);
      const bool any_failed = backend_.failed_calls() > failed_before;
      EXPECT_EQ(pool.owns(p), !failure.empty()) << where << ": " << failure;
      if (pool.owns(p)) {
        EXPECT_EQ(failure_of([&] { pool.deallocate(p); }, where), "") << where;
      }
      EXPECT_FALSE(pool.owns(p)) << where;
      EXPECT_EQ(pool.stats().ranges, 1u) << where;
      EXPECT_EQ(pool.stats().device_backed_bytes, g) << where;
      EXPECT_EQ(failure_of([&] { pool.migrate(other, MemoryLocation::host); }, where), "") << where;
      EXPECT_EQ(pool.stats().deferred_releases, 0u) << where;
      EXPECT_EQ(backend_.live_physicals(), 1u) << where;  // other's
      pool.deallocate(other);
      if (!any_failed) break;
    }
  }
  EXPECT_EQ(backend_.live_physicals(), 0u);
}

// An allocation that fails half-way gives back what it built, even when that fails too.
TEST_F(VmmFailureTest, AFailedAllocationGivesBackItsBackingsEvenWhenTheirReleaseFails) {
  const std::size_t g = backend_.granularity();
  const std::size_t n = (VmmPool::kChunkGranules + 2) * g;  // two chunks
  {
    VmmPool pool(backend_);
    backend_.fail_calls_to("map", 1, 1);               // the second chunk's
    backend_.fail_calls_to("release_physical", 1);     // its backing's release
    EXPECT_THROW(pool.allocate(n, kTagOptimizerState), TieringError);
    EXPECT_EQ(pool.stats().ranges, 0u);
    EXPECT_EQ(pool.stats().device_backed_bytes, 0u);
    EXPECT_EQ(pool.stats().deferred_releases, 1u);
    EXPECT_EQ(backend_.live_physicals(), 1u);

    // Undoing fails as well (the first chunk's unmap): the pool keeps the half-built
    // range, and frees it when it is destroyed.
    backend_.fail_calls_to("map", 1, 1);
    backend_.fail_calls_to("unmap", 1);
    EXPECT_THROW(pool.allocate(n, kTagOptimizerState), TieringError);
    EXPECT_EQ(pool.stats().deferred_releases, 0u);  // retried at the start of the call
    EXPECT_EQ(backend_.live_physicals(), 1u);       // the kept range's first chunk
  }
  EXPECT_EQ(backend_.live_physicals(), 0u);
}

// Note [A lost use stream]: a stream recorded as a user and destroyed without
// release_stream, with work still queued on it. The migration waits for that work (a
// device synchronization), then the dead stream is no user any more.
TEST_F(VmmFailureTest, AStreamDestroyedUnreleasedIsWaitedForByADeviceSynchronize) {
  VmmPool pool(backend_);
  const auto [p, n, data] = allocate_filled(pool, backend_.granularity(), 31);
  ASSERT_NE(p, nullptr);
  const Stream lost = new_user_stream(pool, p);
  tiering_test::StreamGate gate;
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
  inner_->launch_host_func(lost, &tiering_test::StreamGate::wait, &gate);
  // The host backend's destroy returns once the queued work ran; cudaStreamDestroy returns
  // at once. Either way the handle is dead while the work still runs.
  std::thread destroyer([&] { inner_->destroy_stream(lost); });
  test_support::wait_until_stream_handle_is_dead(*inner_, lost);
  auto migrated = std::async(std::launch::async, [&] { pool.migrate(p, MemoryLocation::host); });
  // Not a timing bound: a migration that ends while the lost stream's work is held is the
  // failure.
  EXPECT_EQ(migrated.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  gate.open();
  EXPECT_NO_THROW(migrated.get());
  destroyer.join();
  EXPECT_EQ(pool.stats().lost_stream_syncs, 1u);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), n);
  EXPECT_EQ(difference(p, data), -1);
  // The dead stream is no user any more: no second synchronization.
  pool.migrate(p, MemoryLocation::device);
  pool.deallocate(p);
  EXPECT_EQ(pool.stats().lost_stream_syncs, 1u);
  EXPECT_EQ(backend_.live_physicals(), 0u);
}

// Note [A use stream of another device] (vmm_migration.cpp): a live stream the pool's event
// cannot be recorded on is waited for itself, and stays a user; no device synchronization.
TEST_F(VmmFailureTest, ALiveUseStreamAnEventCannotBeRecordedOnIsWaitedForAndKept) {
  VmmPool pool(backend_);
  const auto [p, n, data] = allocate_filled(pool, backend_.granularity(), 33);
  ASSERT_NE(p, nullptr);
  const Stream other = new_user_stream(pool, p);
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round == 0 ? "the record refused" : "a later migration");
    tiering_test::StreamGate gate;
    const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
    inner_->launch_host_func(other, &tiering_test::StreamGate::wait, &gate);
    if (round == 0) backend_.fail_calls_to("record_event", 1);
    const auto to = round == 0 ? MemoryLocation::host : MemoryLocation::device;
    auto migrated = std::async(std::launch::async, [&, to] { pool.migrate(p, to); });
    // Not a timing bound: a migration that ends while the stream's work is held is the
    // failure (in the later round: the stream was dropped as a user).
    EXPECT_EQ(migrated.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
    gate.open();
    EXPECT_NO_THROW(migrated.get());
    EXPECT_EQ(pool.bytes_in(p, to), n);
    EXPECT_EQ(difference(p, data), -1);
  }
  EXPECT_EQ(pool.stats().lost_stream_syncs, 0u);
  pool.deallocate(p);
  inner_->destroy_stream(other);
}

// A lost stream's device synchronization covers the pool's device alone: a peer's stream
// after it in the list (Note [A use stream of another device]) is still waited for.
TEST_F(VmmFailureTest, APeersStreamAfterALostStreamIsStillWaitedFor) {
  // Device 0's backend, on which streams of device 1 take no event of device 0, as on CUDA.
  struct PeerAware : ForwardingBackend {
    Backend& peer;
    std::set<void*> peer_streams;
    PeerAware(Backend& own, Backend& p) : ForwardingBackend(own), peer(p) {}
    void do_record_event(Event e, Stream s) override {
      if (peer_streams.contains(s.handle)) throw BackendError("an event of device 0 on device 1");
      ForwardingBackend::do_record_event(e, s);
    }
    void do_stream_synchronize(Stream s) override {
      if (peer_streams.contains(s.handle)) return peer.stream_synchronize(s);
      ForwardingBackend::do_stream_synchronize(s);
    }
  };
  const std::unique_ptr<Backend> device1 = make_host_backend(1);
  PeerAware backend(*inner_, *device1);
  VmmPool pool(backend);
  void* p = pool.allocate(backend.granularity(), kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  const Stream lost = inner_->create_stream();
  const Stream peer = device1->create_stream();
  backend.peer_streams.insert(peer.handle);
  pool.record_use(p, lost);
  pool.record_use(p, peer);
  inner_->destroy_stream(lost);  // without release_stream: lost
  tiering_test::StreamGate gate;
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
  device1->launch_host_func(peer, &tiering_test::StreamGate::wait, &gate);  // the peer's kernel
  auto migrated = std::async(std::launch::async, [&] { pool.migrate(p, MemoryLocation::host); });
  // Not a timing bound: a migration that ends while the peer's work is held is the failure.
  EXPECT_EQ(migrated.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout);
  gate.open();
  EXPECT_NO_THROW(migrated.get());
  EXPECT_EQ(pool.stats().lost_stream_syncs, 1u);
  pool.release_stream(peer);
  pool.deallocate(p);
  device1->destroy_stream(peer);
}

TEST_F(VmmFailureTest, ALostStreamWhoseDeviceSynchronizeFailsChangesNothing) {
  VmmPool pool(backend_);
  const auto [p, n, data] = allocate_filled(pool, backend_.granularity(), 32);
  ASSERT_NE(p, nullptr);
  const Stream lost = new_user_stream(pool, p);
  inner_->destroy_stream(lost);
  backend_.fail_calls_to("device_synchronize", 1);
  const std::string error = failure_of([&] { pool.migrate(p, MemoryLocation::host); }, "migrate");
  EXPECT_NE(error.find("synchronizing the device instead failed"), std::string::npos) << error;
  EXPECT_NE(error.find("tidepool_release_stream"), std::string::npos) << error;
  EXPECT_EQ(pool.stats().lost_stream_syncs, 0u);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), n);
  EXPECT_EQ(difference(p, data), -1);
  // The stream is still a user: the next call synchronizes, and goes on.
  pool.migrate(p, MemoryLocation::host);
  EXPECT_EQ(pool.stats().lost_stream_syncs, 1u);
  EXPECT_EQ(difference(p, data), -1);
  pool.deallocate(p);
  EXPECT_EQ(backend_.live_physicals(), 0u);
}

}  // namespace
}  // namespace tidepool
