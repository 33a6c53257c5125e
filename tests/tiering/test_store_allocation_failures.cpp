// The tiered store when the C++ heap runs out part-way through an operation: this binary
// replaces operator new (tests/support/failing_operator_new.h), and each test sweeps the
// allocation that fails, n = 0, 1, 2, ..., until the operation goes through. After every
// failure the handle is usable as before (not left pinned, its contents intact, not
// resident with a buffer that never received them) and nothing is charged that nothing
// holds (a destroyed store's device bytes are all freed).
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/tags.h"
#include "tests/support/failing_operator_new.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using test_support::survives;
using tiering_test::first_difference;
using tiering_test::random_bytes;

constexpr std::size_t kBytes = 64 << 10;
constexpr long kMaxAllocations = 10000;  // no operation here allocates nearly this often

class StoreAllocationFailuresTest : public tiering_test::TieringStreamTest {
 protected:
  TieredStoreOptions options() { return tiering_test::test_store_options(8 * kBytes); }
  TieredStore::Handle create_written(TieredStore& store, std::uint64_t seed) {
    const auto h = store.create(kBytes, kTagOptimizerState);
    store.write(h, random_bytes(kBytes, seed).data());
    return h;
  }
  // The handle's contents, through an acquire: what the device copy holds.
  bool acquires(TieredStore& store, TieredStore::Handle h, std::uint64_t seed) {
    const auto seen = read_device(store.acquire(h, stream_), kBytes, stream_);
    store.release(h, /*dirty=*/false);
    return first_difference(seen.data(), random_bytes(kBytes, seed).data(), kBytes) == -1;
  }
};

// Note [A failed acquire to overwrite], for a failure after the skipped load, and the
// acquire's bookkeeping before its pin (tiered_store.cpp, acquire_locked).
TEST_P(StoreAllocationFailuresTest, AnAcquireThatRunsOutOfMemoryLeavesTheHandleAsItWas) {
  for (const bool overwrite : {false, true}) {
    SCOPED_TRACE(overwrite ? "acquire_to_overwrite" : "acquire");
    long failures = 0;
    for (long n = 0; n < kMaxAllocations; ++n) {
      TieredStore store(backend(), options());
      const auto h = create_written(store, 7);
      // A recorded first step, so that the acquire also goes through the policy's record.
      store.begin_step();
      void* dev = nullptr;
      const bool done = survives(n, [&] {
        dev = overwrite ? store.acquire_to_overwrite(h, stream_) : store.acquire(h, stream_);
      });
      if (done) {
        ASSERT_NE(dev, nullptr);
        store.release(h, /*dirty=*/false);
        store.end_step();
        store.destroy(h);
        break;
      }
      ++failures;
      SCOPED_TRACE("allocation " + std::to_string(n) + " failed");
      store.end_step();
      // Not pinned (a pinned handle cannot be evicted), and its contents are the host copy.
      store.evict(h);
      EXPECT_FALSE(store.resident(h));
      EXPECT_TRUE(acquires(store, h, 7));
      store.destroy(h);
      EXPECT_EQ(store.stats().acquires, 1u) << "the failed acquire was counted";
    }
    EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
  }
}

TEST_P(StoreAllocationFailuresTest, ACreateThatRunsOutOfMemoryHoldsNothing) {
  for (const Tier tier : {Tier::host, Tier::device}) {
    long failures = 0;
    for (long n = 0; n < kMaxAllocations; ++n) {
      TieredStore store(backend(), options());
      const std::size_t host_before = store.stats().host.pinned_in_use_bytes;
      TieredStore::Handle h{};
      if (survives(n, [&] { h = store.create(kBytes, kTagOptimizerState, tier); })) {
        store.destroy(h);
        break;
      }
      ++failures;
      SCOPED_TRACE("allocation " + std::to_string(n) + " failed");
      EXPECT_EQ(store.stats().host.pinned_in_use_bytes, host_before);
      EXPECT_EQ(store.stats().device_bytes, 0u) << "a buffer no handle holds is charged";
      // The store works on: a handle of the whole budget still fits.
      const auto whole = store.create(8 * kBytes, kTagOptimizerState, tier);
      store.destroy(whole);
    }
    EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
  }
}

// A destroy of a handle on the recorded schedule, failing at each of its allocations in
// turn: it either changes nothing (the handle is whole and its destroy goes through
// later) or the handle is gone; never a handle whose host block was freed but which
// stayed (its block was freed again at the store's teardown: ASan double free).
TEST_P(StoreAllocationFailuresTest, ADestroyThatRunsOutOfMemoryNeverLeavesAFreedHandle) {
  long failures = 0;
  for (long n = 0; n < kMaxAllocations; ++n) {
    TieredStore store(backend(), options());
    const auto kept = create_written(store, 3);
    const auto h = create_written(store, 5);
    for (int step = 0; step < 2; ++step) {  // a recorded, replayed schedule naming both
      store.begin_step();
      EXPECT_TRUE(acquires(store, kept, 3));
      EXPECT_TRUE(acquires(store, h, 5));
      store.end_step();
    }
    if (survives(n, [&] { store.destroy(h); })) break;
    ++failures;
    SCOPED_TRACE("allocation " + std::to_string(n) + " failed");
    bool still_there = true;
    try {
      (void)store.resident(h);
    } catch (const TieringError&) {
      still_there = false;
    }
    if (still_there) {
      EXPECT_TRUE(acquires(store, h, 5)) << "a handle kept by a failed destroy lost its data";
      store.destroy(h);
    }
    EXPECT_TRUE(acquires(store, kept, 3));
    store.begin_step();  // the schedule works on
    EXPECT_TRUE(acquires(store, kept, 3));
    store.end_step();
  }
  EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
}

// Review finding: the destructor gathered each handle's two events (and each pending
// free's) into a list outside its guarded steps, so a store with more handles than the
// list had room for called std::terminate when the heap ran out at its teardown (a
// destructor must not throw: teardown.h).
TEST_P(StoreAllocationFailuresTest, AStoreWithManyHandlesIsDestroyedWithoutAHeap) {
  auto store = std::make_unique<TieredStore>(backend(), options());
  for (std::uint64_t i = 0; i < 64; ++i) {
    const auto h = create_written(*store, i);
    if (i % 2 == 0) {
      EXPECT_TRUE(acquires(*store, h, i));  // some with a device copy
    }
  }
  bool completed = false;
  ::testing::internal::CaptureStderr();
  std::thread([&] {
    completed = test_support::survives_exhaustion(0, [&] { store.reset(); });
  }).join();
  ::testing::internal::GetCapturedStderr();
  EXPECT_TRUE(completed);
  EXPECT_EQ(store, nullptr);
}

// A step of a new schedule key begun while the heap runs out: whatever failed, the
// handles are acquired as before (a key made current without its schedule made every
// acquire throw until the next step began).
TEST_P(StoreAllocationFailuresTest, ABeginStepThatRunsOutOfMemoryLeavesAcquiresWorking) {
  long failures = 0;
  for (long n = 0; n < kMaxAllocations; ++n) {
    TieredStore store(backend(), options());
    const auto h = create_written(store, 11);
    store.begin_step(1);
    EXPECT_TRUE(acquires(store, h, 11));
    store.end_step();
    if (survives(n, [&] { store.begin_step(2); })) {
      store.end_step();
      break;
    }
    ++failures;
    SCOPED_TRACE("allocation " + std::to_string(n) + " failed");
    EXPECT_NO_THROW(EXPECT_TRUE(acquires(store, h, 11)));
    store.end_step();
  }
  EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
}

// Review finding: the caching allocator's source took any std::bad_alloc for a full device,
// its own bookkeeping's too, so the store evicted all it had released (other handles'
// state, moved for nothing) and retried. Only OutOfMemoryError means a full device: with
// room on the device for both handles, an acquire whose heap fails at any point evicts
// nothing.
TEST(CachingAllocatorSourceFailures, TheHeapRunningOutIsNotAFullDevice) {
  long failures = 0;
  for (long n = 0; n < kMaxAllocations; ++n) {
    CachingAllocator allocator(make_host_backend(0));
    TieredStore store(allocator.backend(), tiering_test::test_store_options(8 * kBytes),
                      caching_allocator_source(allocator));
    const Stream stream = allocator.backend().create_stream();
    const auto other = store.create(kBytes, kTagOptimizerState, Tier::device);
    const auto h = store.create(kBytes, kTagOptimizerState, Tier::host);
    store.synchronize();
    bool done = false;
    std::thread([&] {
      done = survives(n, [&] { store.acquire(h, stream); });
    }).join();
    EXPECT_TRUE(store.resident(other)) << "allocation " << n << (done ? " (went through)" : "");
    EXPECT_EQ(store.stats().evictions, 0u) << "allocation " << n;
    if (done) store.release(h, /*dirty=*/false);
    store.synchronize();
    store.destroy(h);
    store.destroy(other);
    allocator.backend().destroy_stream(stream);
    if (done) break;
    ++failures;
  }
  EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
}

INSTANTIATE_TEST_SUITE_P(Host, StoreAllocationFailuresTest,
                         ::testing::Values(BackendKind::host),
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
