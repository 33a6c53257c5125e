// Destruction when the backend dies: TieredStore (with its CopyEngine and HostArena) and
// VmmPool must never throw or abort when every backend call fails from some point on (as
// the cuda backend does once its context is destroyed at process exit). Each test sweeps
// that point across the whole teardown: n = 0 fails the first release step, larger n
// fail later steps, until a teardown runs clean. Host backend only: the failures are
// injected by a wrapper around it (failing_backend.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>

#include "allocator/tags.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/host_arena.h"
#include "tiering/teardown.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::FailingBackend;

constexpr long kMaxSteps = 400;  // far more backend calls than any teardown here makes

// Builds an object on a FailingBackend over a fresh host backend via `build` (the backend
// still works), lets every stream finish, makes the backend fail after `n` more calls,
// then destroys the object via `destroy`. Returns the teardown errors it reported.
struct TeardownRun {
  std::uint64_t errors = 0;
  long failed_calls = 0;
};
// `quiet`: swallow the stderr lines the failed teardowns write.
TeardownRun run_with_failure_after(long n, const std::function<void(Backend&)>& build,
                                   const std::function<void()>& destroy, bool quiet = true) {
  auto inner = make_host_backend(0);
  TeardownRun result;
  {
    FailingBackend backend(*inner);
    build(backend);
    inner->device_synchronize();  // nothing in flight: a leak-free release is possible
    const std::uint64_t before = teardown_error_count();
    backend.fail_after(n);
    if (quiet) testing::internal::CaptureStderr();
    EXPECT_NO_THROW(destroy());
    if (quiet) testing::internal::GetCapturedStderr();
    result.errors = teardown_error_count() - before;
    result.failed_calls = backend.failed_calls();
  }
  return result;  // the host backend frees whatever the object could not release
}

// Sweeps n from 0 until a teardown runs clean; every run must survive.
void sweep(const std::function<void(Backend&)>& build, const std::function<void()>& destroy) {
  const TeardownRun first = run_with_failure_after(0, build, destroy);
  EXPECT_GT(first.errors, 0u) << "a backend failing from the start must be noticed";
  EXPECT_GT(first.failed_calls, 0);
  long n = 1;
  for (; n < kMaxSteps; ++n) {
    const TeardownRun r = run_with_failure_after(n, build, destroy);
    // A teardown that met failures says so. (Not one count per failed call: unmapping
    // a direct pinned block releases it even when its unregistration failed, so
    // HostArena::deallocate does not report that as a failed release.)
    EXPECT_EQ(r.errors > 0, r.failed_calls > 0) << "n = " << n;
    EXPECT_LE(static_cast<long>(r.errors), r.failed_calls) << "n = " << n;
    if (r.failed_calls == 0) break;  // n calls were enough for the whole teardown
  }
  EXPECT_LT(n, kMaxSteps) << "the teardown never ran clean";
  EXPECT_GT(n, 3) << "the sweep should cross several release steps";
}

TieredStoreOptions store_options() {
  TieredStoreOptions o = tiering_test::small_chunk_store_options(std::size_t{8} << 20);
  // Direct pinned mappings only: a slab whose unregistration fails is abandoned, and
  // mimalloc allows 64 arenas per process.
  o.host.direct_threshold_bytes = 64 << 10;
  return o;
}

TEST(TieredStoreTeardown, BackendDyingAtAnyStepNeverThrowsOrAborts) {
  std::unique_ptr<TieredStore> store;
  Stream stream;
  auto build = [&](Backend& b) {
    store = std::make_unique<TieredStore>(b, store_options());
    stream = b.create_stream();
    // One handle in each state: resident and dirty, evicted with its buffer still a
    // pending free, on the host, created on the device.
    const auto dirty = store->create(256 << 10, kTagOptimizerState);
    store->acquire(dirty, stream);
    store->release(dirty, /*dirty=*/true);
    const auto evicted = store->create(128 << 10, kTagOptimizerState);
    store->acquire(evicted, stream);
    store->release(evicted, /*dirty=*/true);
    store->evict(evicted);
    store->create(64 << 10, kTagOptimizerState);
    store->create(192 << 10, kTagOptimizerState, Tier::device);
  };
  sweep(build, [&] { store.reset(); });
}

TEST(TieredStoreTeardown, AFailedTeardownSaysSoOnceOnStderr) {
  std::unique_ptr<TieredStore> store;
  auto build = [&](Backend& b) {
    store = std::make_unique<TieredStore>(b, store_options());
    store->create(64 << 10, kTagOptimizerState, Tier::device);
  };
  testing::internal::CaptureStderr();
  const TeardownRun r = run_with_failure_after(0, build, [&] { store.reset(); }, /*quiet=*/false);
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_GT(r.errors, 1u);
  // One line per object (store, copy engine, host arena), not one per failed call.
  EXPECT_NE(err.find("tidepool: tiered store destroyed with"), std::string::npos) << err;
  EXPECT_NE(err.find("the backend is gone"), std::string::npos) << err;
  EXPECT_EQ(err.find("tidepool: tiered store destroyed", err.find("tiered store") + 1),
            std::string::npos)
      << err;
}

// The stderr line names every distinct failure (a repeated one with its count) up to
// Teardown::kNamedFailures, then counts the rest: several ranges or buffers failing for
// different reasons must all show, not only the first.
TEST(TeardownLine, NamesEveryFailureUpToALimitAndCountsTheRest) {
  static_assert(Teardown::kNamedFailures == 4, "the expectations below name four");
  auto fail = [](const char* message) {
    return [message] { throw std::runtime_error(message); };
  };
  const std::uint64_t before = teardown_error_count();
  testing::internal::CaptureStderr();
  {
    Teardown t("test object");
    t.attempt("step one", fail("error one"));
    t.attempt("step two", fail("error two"));
    EXPECT_TRUE(t.attempt("a step that works", [] {}));
    t.attempt("step two", fail("error two"));
    t.attempt("step two", fail("another error"));
    t.attempt("step three", fail("error three"));
    t.attempt("step four", fail("error four"));
    t.attempt("step five", fail("error five"));
    EXPECT_EQ(t.failures(), 7);
  }
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_EQ(teardown_error_count() - before, 7u);
  EXPECT_NE(err.find("tidepool: test object destroyed with 7 failed release steps"),
            std::string::npos) << err;
  EXPECT_NE(err.find("step one: error one; step two: error two (2 times); "
                     "step two: another error; step three: error three; and 2 more failed steps"),
            std::string::npos) << err;
  EXPECT_EQ(err.find("step four"), std::string::npos) << err;
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
}

// A store whose teardown fails at two different steps names both in its line.
TEST(TieredStoreTeardown, EveryFailedStepIsNamedInTheLine) {
  std::unique_ptr<TieredStore> store;
  auto inner = make_host_backend(0);
  FailingBackend backend(*inner);
  store = std::make_unique<TieredStore>(backend, store_options());
  store->create(64 << 10, kTagOptimizerState, Tier::device);
  inner->device_synchronize();
  backend.fail_calls_to("device_synchronize", 1);
  backend.fail_calls_to("destroy_event", 1);
  testing::internal::CaptureStderr();
  store.reset();
  const std::string err = testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tidepool: tiered store destroyed with 2 failed release steps"),
            std::string::npos) << err;
  EXPECT_NE(err.find("synchronising the device: failing backend: device_synchronize"),
            std::string::npos) << err;
  EXPECT_NE(err.find("destroying an event: failing backend: destroy_event"), std::string::npos)
      << err;
}

// A mimalloc slab the dying backend cannot unregister is abandoned (kept mapped and
// reachable, never handed to another arena); a slab with a block its owner leaked too.
TEST(HostArenaTeardown, SlabsThatCannotBeUnregisteredAreAbandonedQuietly) {
  std::unique_ptr<HostArena> arena;
  auto build = [&](Backend& b) {
    arena = std::make_unique<HostArena>(b, tiering_test::test_host_options());
    const HostBlock block = arena->allocate(4096);  // small: from a slab
    ASSERT_EQ(block.tier, HostTier::pinned) << arena->stats().last_fallback_reason;
    arena->deallocate(block);
  };
  const TeardownRun r = run_with_failure_after(0, build, [&] { arena.reset(); });
  EXPECT_EQ(r.errors, 1u);  // the one unregistration
  EXPECT_EQ(r.failed_calls, 1);
}

TEST(VmmPoolTeardown, BackendDyingAtAnyStepNeverThrowsOrAborts) {
  std::unique_ptr<VmmPool> pool;
  auto build = [&](Backend& b) {
    pool = std::make_unique<VmmPool>(b);
    const Stream s = b.create_stream();
    void* on_device = pool->allocate(3 * b.granularity(), kTagOptimizerState);
    void* on_host = pool->allocate(b.granularity(), kTagOptimizerState);
    ASSERT_NE(on_device, nullptr);
    ASSERT_NE(on_host, nullptr);
    pool->migrate(on_host, MemoryLocation::host);
    pool->record_use(on_device, s);
  };
  sweep(build, [&] { pool.reset(); });
}

}  // namespace
}  // namespace tidepool
