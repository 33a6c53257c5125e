// TieredStore behaviour: residency, clean vs dirty eviction, the budget and its errors,
// the recorded prefetch schedule (and its following a handle created later, steps of two
// shapes in turn, a doubled step), reclaim,
// and fault injection at the seam (the last good copy must stay readable after every
// failure).
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "allocator/tags.h"
#include "tests/support/backend_errors.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/stats_json.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using tiering_test::acquire_on_new_stream;
using tiering_test::contents;
using tiering_test::first_difference;
using tiering_test::random_bytes;
using tiering_test::StreamGate;

class TieredStoreTest : public tiering_test::TieringStreamTest {
 protected:
  TieredStoreOptions options(std::size_t budget) {
    return tiering_test::small_chunk_store_options(budget);
  }
  // Writes `data` through the device pointer of an acquired handle, on stream_.
  void write_device(void* dev, const std::vector<unsigned char>& data) {
    backend().copy_async(dev, data.data(), data.size(), CopyKind::host_to_device, stream_);
    backend().stream_synchronize(stream_);  // `data` may go out of scope after this
  }
  // Three 100 KiB handles on the host, the first two acquired on stream_: the room
  // left in the budget decides what happens to the third.
  std::array<TieredStore::Handle, 3> acquire_two_of_three(TieredStore& store) {
    std::array<TieredStore::Handle, 3> h{};
    for (auto& x : h) x = store.create(100 << 10, kTagOptimizerState);
    store.acquire(h[0], stream_);
    store.acquire(h[1], stream_);
    return h;
  }
  // A new handle of `store` whose host copy holds `bytes` random bytes from `seed`.
  struct WrittenHandle {
    TieredStore::Handle handle;
    std::vector<unsigned char> data;
  };
  WrittenHandle create_written(TieredStore& store, std::size_t bytes, std::uint64_t seed) {
    WrittenHandle written{store.create(bytes, kTagOptimizerState), random_bytes(bytes, seed)};
    store.write(written.handle, written.data.data());
    return written;
  }
};

TEST_P(TieredStoreTest, NewHandlesAreZeroOnEitherTier) {
  TieredStore store(backend(), options(1 << 20));
  for (Tier t : {Tier::host, Tier::device}) {
    auto h = store.create(100000, kTagOptimizerState, t);
    EXPECT_EQ(store.resident(h), t == Tier::device);
    void* dev = store.acquire(h, stream_);
    const auto seen = read_device(dev, 100000, stream_);
    store.release(h, false);
    EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](unsigned char c) { return c == 0; }));
    store.destroy(h);
  }
}

TEST_P(TieredStoreTest, DirtyEvictionCopiesBackCleanEvictionDoesNot) {
  TieredStore store(backend(), options(1 << 20));
  auto h = store.create(300000, kTagOptimizerState);
  const auto data = random_bytes(300000, 7);
  write_device(store.acquire(h, stream_), data);
  store.release(h, /*dirty=*/true);
  store.evict(h);
  EXPECT_FALSE(store.resident(h));
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), data.size()), -1);
  const auto d2h_before = store.stats().copy.d2h.bytes;
  EXPECT_EQ(d2h_before, 300000u);

  // Acquire again, only read: a clean eviction drops the copy without moving bytes.
  const auto seen = read_device(store.acquire(h, stream_), 300000, stream_);
  EXPECT_EQ(first_difference(seen.data(), data.data(), data.size()), -1);
  store.release(h, /*dirty=*/false);
  store.evict(h);
  const TieredStoreStats s = store.stats();
  EXPECT_EQ(s.copy.d2h.bytes, d2h_before);
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.evictions_clean, 1u);
  store.synchronize();
  EXPECT_EQ(store.device_bytes(), 0u);
}

// Regression (data loss in the integrity test): a release ends the caller's claim, not the
// work its stream still has queued. An acquire on another stream must order its work after
// that work: its reads must see the earlier writes, and its writes must land after them
// and after the earlier reads. Stream A is held by a gate, so A's read and write have
// certainly not run when B's work is enqueued: without the ordering, B overtakes A.
TEST_P(TieredStoreTest, AcquireOnAnotherStreamWaitsForEarlierUses) {
  // A D2H copy to pageable memory blocks the host on CUDA while the gate holds the stream.
  if (!on_host()) GTEST_SKIP() << "needs host-backend copies that never block the caller";
  Backend& b = backend();
  TieredStore store(b, options(1 << 20));
  constexpr std::size_t n = 200000;
  auto h = store.create(n, kTagOptimizerState);
  const auto old_data = random_bytes(n, 21);
  const auto a_data = random_bytes(n, 22);
  const auto b_data = random_bytes(n, 23);
  store.write(h, old_data.data());
  const Stream other = b.create_stream();
  StreamGate gate;
  std::vector<unsigned char> seen_by_a(n), seen_by_b(n);

  b.launch_host_func(stream_, &StreamGate::wait, &gate);
  void* dev_a = store.acquire(h, stream_);
  b.copy_async(seen_by_a.data(), dev_a, n, CopyKind::device_to_host, stream_);
  b.copy_async(dev_a, a_data.data(), n, CopyKind::host_to_device, stream_);
  store.release(h, /*dirty=*/true);

  void* dev_b = store.acquire(h, other);
  b.copy_async(seen_by_b.data(), dev_b, n, CopyKind::device_to_host, other);
  b.copy_async(dev_b, b_data.data(), n / 2, CopyKind::host_to_device, other);
  store.release(h, /*dirty=*/true);
  const Event b_done = b.create_event();
  b.record_event(b_done, other);
  // Without the ordering B finishes in microseconds; 50 ms only bounds what a correct
  // store costs this test. (No ASSERT before open(): a held stream would hang teardown.)
  bool b_ran_while_a_held = false;
  for (int i = 0; i < 50 && !b_ran_while_a_held; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    b_ran_while_a_held = b.event_query(b_done);
  }
  gate.open();
  b.stream_synchronize(other);
  b.stream_synchronize(stream_);
  EXPECT_FALSE(b_ran_while_a_held) << "stream B passed its acquire before A's queued work ran";
  EXPECT_EQ(first_difference(seen_by_a.data(), old_data.data(), n), -1);
  EXPECT_EQ(first_difference(seen_by_b.data(), a_data.data(), n), -1);
  std::vector<unsigned char> expected(b_data.begin(), b_data.begin() + n / 2);
  expected.insert(expected.end(), a_data.begin() + n / 2, a_data.end());
  EXPECT_EQ(first_difference(contents(store, h).data(), expected.data(), n), -1);
  store.evict(h);  // the copy back must see both streams' writes as well
  EXPECT_EQ(first_difference(contents(store, h).data(), expected.data(), n), -1);
  b.destroy_event(b_done);
  b.destroy_stream(other);
}

// Note [Use streams]: a stream that used a handle stays its user after release; before
// it is destroyed, release_stream waits for it and forgets it, so the handle (and the
// eviction choices of the store) are not tied to a dead stream.
TEST_P(TieredStoreTest, AReleasedStreamIsForgottenAndTheStateSurvivesItsDestruction) {
  Backend& b = backend();
  TieredStore store(b, options(1 << 20));
  constexpr std::size_t n = 100000;
  const auto [h, temporary, dev] = acquire_on_new_stream(store, n, kTagOptimizerState);
  const auto data = random_bytes(n, 31);
  b.copy_async(dev, data.data(), n, CopyKind::host_to_device, temporary);  // not waited for
  store.release(h, /*dirty=*/true);
  store.release_stream(temporary);  // waits for the copy above
  b.destroy_stream(temporary);
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), n), -1);
  store.evict(h);
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), n), -1);
  store.acquire(h, stream_);
  store.release(h, /*dirty=*/false);
  store.destroy(h);
}

TEST_P(TieredStoreTest, AStreamDestroyedWithoutReleaseIsAClearErrorAndLosesNothing) {
  // On CUDA, recording on a destroyed stream is undefined: only the host backend can say.
  if (!on_host()) GTEST_SKIP() << "the host backend reports a destroyed stream";
  Backend& b = backend();
  TieredStore store(b, options(1 << 20));
  constexpr std::size_t n = 100000;
  const auto [h, temporary, dev] = acquire_on_new_stream(store, n, kTagOptimizerState);
  const auto data = random_bytes(n, 32);
  b.stream_synchronize(temporary);  // the load is done: stream_ may write now
  write_device(dev, data);
  store.release(h, /*dirty=*/true);
  b.destroy_stream(temporary);
  for (const auto& [name, operation] : std::vector<std::pair<const char*, std::function<void()>>>{
           {"evict", [&] { store.evict(h); }},
           {"acquire", [&] { store.acquire(h, stream_); }},
           {"read", [&] { contents(store, h); }}}) {
    try {
      operation();
      ADD_FAILURE() << name << " waited on a destroyed stream without an error";
    } catch (const TieringError& e) {
      EXPECT_NE(std::string(e.what()).find("release_stream"), std::string::npos) << e.what();
    }
  }
  // The device copy is still the latest; once the dead stream is forgotten, it comes back.
  EXPECT_TRUE(store.resident(h));
  store.forget_stream(temporary);
  store.evict(h);
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), n), -1);
  store.destroy(h);
}

// Note [A victim that cannot be evicted] (store_budget.cpp): a released handle whose use
// stream was destroyed without release_stream cannot be evicted; the room an acquire
// needs, and what a reclaim asks for, come from the other handles instead (review
// finding: the failing handle stayed the first victim, and every acquire that needed room
// and every reclaim failed with its error until the stream was forgotten).
TEST_P(TieredStoreTest, AHandleThatCannotBeEvictedLeavesTheOthersEvictable) {
  if (!on_host()) GTEST_SKIP() << "the host backend reports a destroyed stream";
  Backend& b = backend();
  constexpr std::size_t n = 1 << 20;
  TieredStore store(b, options(2 * n));
  const auto [stuck, temporary, dev] = acquire_on_new_stream(store, n, kTagOptimizerState);
  const auto data = random_bytes(n, 35);
  b.stream_synchronize(temporary);
  write_device(dev, data);
  store.release(stuck, /*dirty=*/true);
  b.destroy_stream(temporary);
  const TieredStore::Handle other = store.create(n, kTagOptimizerState);
  store.acquire(other, stream_);
  store.release(other, /*dirty=*/true);
  ASSERT_TRUE(store.resident(stuck) && store.resident(other));
  const TieredStore::Handle incoming = store.create(n, kTagOptimizerState);
  EXPECT_NO_THROW(store.acquire(incoming, stream_));  // the room is `other`'s
  EXPECT_TRUE(store.resident(stuck));
  EXPECT_FALSE(store.resident(other));
  store.release(incoming, /*dirty=*/false);
  EXPECT_EQ(store.reclaim(2 * n), n);  // `incoming`; `stuck` stays, said once
  EXPECT_TRUE(store.resident(stuck));
  EXPECT_FALSE(store.resident(incoming));
  // Nothing else to evict: the acquire fails with the stuck handle's error.
  store.acquire(other, stream_);
  const TieredStore::Handle third = store.create(n, kTagOptimizerState);
  try {
    store.acquire(third, stream_);
    ADD_FAILURE() << "no room, and no error";
  } catch (const TieringError& e) {
    EXPECT_NE(std::string(e.what()).find("release_stream"), std::string::npos) << e.what();
  }
  store.release(other, /*dirty=*/false);
  store.forget_stream(temporary);
  store.evict(stuck);
  EXPECT_EQ(first_difference(contents(store, stuck).data(), data.data(), n), -1);
  for (const TieredStore::Handle h : {stuck, other, incoming, third}) store.destroy(h);
}

// write() and destroy() drop the device copy without copying it back. When that drop
// fails (a use stream destroyed without release_stream), the operation did not happen:
// the dirty device copy must still be the latest, copied back by the next eviction.
TEST_P(TieredStoreTest, AFailedWriteOrDestroyKeepsTheDirtyDeviceCopy) {
  if (!on_host()) GTEST_SKIP() << "the host backend reports a destroyed stream";
  Backend& b = backend();
  TieredStore store(b, options(1 << 20));
  constexpr std::size_t n = 100000;
  const auto replacement = random_bytes(n, 34);
  for (const char* name : {"write", "destroy"}) {
    SCOPED_TRACE(name);
    const auto [h, temporary, dev] = acquire_on_new_stream(store, n, kTagOptimizerState);
    const auto data = random_bytes(n, 33);
    b.stream_synchronize(temporary);
    write_device(dev, data);
    store.release(h, /*dirty=*/true);
    b.destroy_stream(temporary);
    if (std::string(name) == "write") {
      EXPECT_THROW(store.write(h, replacement.data()), TieringError);
    } else {
      EXPECT_THROW(store.destroy(h), TieringError);
    }
    EXPECT_TRUE(store.resident(h));
    store.forget_stream(temporary);
    store.evict(h);
    EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), n), -1);
    store.destroy(h);
  }
}

TEST_P(TieredStoreTest, BudgetEvictsFurthestAndErrorsWhenAllAreAcquired) {
  TieredStore store(backend(), options(256 << 10));
  const auto [a, b, c] = acquire_two_of_three(store);
  const std::string m =
      test_support::expect_error<TieringError>([&] { store.acquire(c, stream_); });
  EXPECT_NE(m.find("acquired"), std::string::npos) << m;
  EXPECT_LE(store.device_bytes(), store.device_budget_bytes());
  store.release(a, false);
  store.acquire(c, stream_);  // evicts a
  EXPECT_FALSE(store.resident(a));
  EXPECT_LE(store.device_bytes(), store.device_budget_bytes());
  store.release(b, false);
  store.release(c, false);
}

TEST_P(TieredStoreTest, MisuseIsAClearError) {
  TieredStore store(backend(), options(1 << 20));
  EXPECT_THROW(store.create(0, kTagOptimizerState), TieringError);
  EXPECT_THROW(store.create(2 << 20, kTagOptimizerState), TieringError);  // larger than the budget
  auto h = store.create(4096, kTagOptimizerState);
  EXPECT_THROW(store.release(h, false), TieringError);     // not acquired
  EXPECT_THROW(store.acquire(h + 1000, stream_), TieringError);
  store.acquire(h, stream_);
  EXPECT_THROW(store.evict(h), TieringError);
  EXPECT_THROW(store.destroy(h), TieringError);
  std::vector<unsigned char> buf(4096);
  EXPECT_THROW(store.read(h, buf.data()), TieringError);
  store.release(h, false);
  store.destroy(h);
  EXPECT_THROW(store.destroy(h), TieringError);
  EXPECT_THROW(TieredStore(backend(), options(0)), TieringError);
}

TEST_P(TieredStoreTest, RecordedStepIsPrefetchedOnReplay) {
  TieredStore store(backend(), options(600 << 10));
  std::vector<TieredStore::Handle> hs;
  for (int i = 0; i < 8; ++i) hs.push_back(store.create(100 << 10, kTagOptimizerState));
  for (int step = 0; step < 4; ++step) {
    store.begin_step();
    for (auto h : hs) {
      store.acquire(h, stream_);
      store.release(h, true);
      ASSERT_LE(store.device_bytes(), store.device_budget_bytes());
    }
    store.end_step();
  }
  const TieredStoreStats s = store.stats();
  // Step 1 records (all misses); later steps find most handles already in flight.
  EXPECT_GT(s.prefetch_issued, 0u);
  EXPECT_GT(s.prefetch_hits, 8u);
  EXPECT_LT(s.misses, 8u + 3u * 8u);
  EXPECT_LE(s.device_peak_bytes, store.device_budget_bytes());
}

TEST_P(TieredStoreTest, AHandleCreatedAfterTheFirstStepIsPrefetchedInLaterSteps) {
  // Eight 100 KiB handles through a 600 KiB budget; a ninth is created after step 1
  // (state made lazily) and acquired mid-step from step 2 on. Step 2 meets it unknown
  // (a miss) and merges it into the schedule (Note [Adopting a step]); from step 3 on it
  // is prefetched like the others instead of evicted first and missed every step.
  TieredStore store(backend(), options(600 << 10));
  std::vector<TieredStore::Handle> order;
  for (int i = 0; i < 8; ++i) order.push_back(store.create(100 << 10, kTagOptimizerState));
  std::uint64_t late_misses = 0;
  std::uint64_t late_hits = 0;
  TieredStore::Handle late = 0;
  for (int step = 0; step < 6; ++step) {
    if (step == 1) {
      late = store.create(100 << 10, kTagOptimizerState);
      order.insert(order.begin() + 4, late);
    }
    store.begin_step();
    for (auto h : order) {
      const TieredStoreStats before = store.stats();
      store.acquire(h, stream_);
      const TieredStoreStats after = store.stats();
      if (h == late && step >= 2) {
        late_misses += after.misses - before.misses;
        late_hits += after.prefetch_hits - before.prefetch_hits;
      }
      store.release(h, true);
      ASSERT_LE(store.device_bytes(), store.device_budget_bytes());
    }
    store.end_step();
  }
  EXPECT_EQ(late_misses, 0u);
  EXPECT_EQ(late_hits, 4u);  // steps 3 to 6
  const TieredStoreStats s = store.stats();
  EXPECT_EQ(s.schedule_adoptions, 1u);
  EXPECT_EQ(s.off_schedule_acquires, 1u);  // step 2's acquire of the new handle
  EXPECT_NE(store.stats_json().find("\"schedule_adoptions\":1"), std::string::npos);
}

TEST_P(TieredStoreTest, StepsAlternatingBetweenTwoShapesMissNothingOnceThePatternHolds) {
  // Six handles every step uses and one of each of two shapes (A, B in turn), 100 KiB
  // each, through a 600 KiB budget: every step evicts. A schedule kept from A alone
  // missed B's handle on every B step; once the pattern has held (Note [Steps of several
  // shapes]) each step replays its own shape, and nothing misses.
  TieredStore store(backend(), options(600 << 10));
  std::vector<TieredStore::Handle> every_step;
  for (int i = 0; i < 6; ++i) every_step.push_back(store.create(100 << 10, kTagOptimizerState));
  const TieredStore::Handle a = store.create(100 << 10, kTagOptimizerState);
  const TieredStore::Handle b = store.create(100 << 10, kTagOptimizerState);
  TieredStoreStats steady{};
  std::uint64_t b_hits = 0;
  for (int step = 0; step < 16; ++step) {
    if (step == 8) steady = store.stats();
    std::vector<TieredStore::Handle> order = every_step;
    order.insert(order.begin() + 3, step % 2 == 0 ? a : b);
    store.begin_step();
    for (auto h : order) {
      const std::uint64_t hits_before = store.stats().prefetch_hits;
      store.acquire(h, stream_);
      if (h == b && step >= 8) b_hits += store.stats().prefetch_hits - hits_before;
      store.release(h, true);
      ASSERT_LE(store.device_bytes(), store.device_budget_bytes());
    }
    store.end_step();
  }
  const TieredStoreStats s = store.stats();
  EXPECT_EQ(s.misses, steady.misses);
  EXPECT_EQ(s.off_schedule_acquires, steady.off_schedule_acquires);
  EXPECT_EQ(b_hits, 4u);  // steps 10, 12, 14 and 16
  EXPECT_EQ(s.schedule_adoptions, 1u);  // b merged in
}

TEST_P(TieredStoreTest, AClosureRunTwiceThatCreatedAHandleIsFollowedOnce) {
  // Step 2 runs its closure twice and creates a handle in the first run. The schedule
  // takes the handle once (Note [Adopting a step]): the normal steps after it follow it,
  // where a doubled schedule was taken back by the second of them (a second adoption).
  TieredStore store(backend(), options(600 << 10));
  std::vector<TieredStore::Handle> order;
  for (int i = 0; i < 4; ++i) order.push_back(store.create(100 << 10, kTagOptimizerState));
  const auto run = [&] {
    for (auto h : order) {
      store.acquire(h, stream_);
      store.release(h, true);
    }
  };
  store.begin_step();
  run();
  store.end_step();
  order.push_back(store.create(100 << 10, kTagOptimizerState));
  store.begin_step();
  run();
  run();
  store.end_step();
  EXPECT_EQ(store.stats().schedule_adoptions, 1u);
  const TieredStoreStats after_doubled = store.stats();
  for (int step = 0; step < 3; ++step) {
    store.begin_step();
    run();
    store.end_step();
  }
  const TieredStoreStats s = store.stats();
  EXPECT_EQ(s.schedule_adoptions, 1u);
  EXPECT_EQ(s.off_schedule_acquires, after_doubled.off_schedule_acquires);
  EXPECT_EQ(s.misses, after_doubled.misses);
}

TEST_P(TieredStoreTest, PrefetchNeverExceedsTheBudgetOrEvictsSoonerUses) {
  TieredStore store(backend(), options(200 << 10));
  const auto [a, b, c] = acquire_two_of_three(store);
  store.prefetch(c, stream_);  // no room, nothing released: skipped
  EXPECT_FALSE(store.resident(c));
  EXPECT_EQ(store.stats().prefetch_skipped, 1u);
  store.release(a, false);
  store.release(b, false);
  // a and b were used, c never: a prefetch of c (a hint) may not give them up for it.
  store.prefetch(c, stream_);
  EXPECT_FALSE(store.resident(c));
  EXPECT_TRUE(store.resident(a));
  EXPECT_TRUE(store.resident(b));
  EXPECT_EQ(store.stats().prefetch_skipped, 2u);
  EXPECT_EQ(store.stats().evictions, 0u);
  store.evict(a);  // room now: the same prefetch goes through
  store.prefetch(c, stream_);
  EXPECT_TRUE(store.resident(c));
  EXPECT_TRUE(store.resident(b));
  EXPECT_LE(store.device_bytes(), store.device_budget_bytes());
}

TEST_P(TieredStoreTest, ReclaimEvictsReleasedState) {
  TieredStore store(backend(), options(1 << 20));
  auto a = store.create(200 << 10, kTagOptimizerState, Tier::device);
  auto b = store.create(200 << 10, kTagOptimizerState, Tier::device);
  store.acquire(b, stream_);
  const std::size_t freed = store.reclaim(1 << 20);
  EXPECT_EQ(freed, std::size_t{200} << 10);  // a only: b is acquired
  EXPECT_FALSE(store.resident(a));
  EXPECT_TRUE(store.resident(b));
  store.release(b, false);
  EXPECT_EQ(store.stats().reclaim_calls, 1u);
}

TEST_P(TieredStoreTest, TagOperationsOnlyTouchThatTag) {
  TieredStore store(backend(), options(1 << 20));
  auto a = store.create(1000, kTagOptimizerState, Tier::device);
  auto b = store.create(1000, TIDEPOOL_TAG_WORKSPACE, Tier::device);
  store.evict_tag(kTagOptimizerState);
  EXPECT_FALSE(store.resident(a));
  EXPECT_TRUE(store.resident(b));
  store.prefetch_tag(kTagOptimizerState, stream_);
  EXPECT_TRUE(store.resident(a));
}

// Review finding: prefetch_tag loaded in the handle map's order, so with room for some of
// the tag's handles it could load the ones needed last, each then evicted by one needed
// sooner. The most recently used (what the policy has without a recorded step) go first.
TEST_P(TieredStoreTest, PrefetchTagLoadsTheHandlesNeededFirst) {
  TieredStore store(backend(), options(200 << 10));
  std::array<TieredStore::Handle, 4> h{};
  for (auto& x : h) x = store.create(100 << 10, kTagOptimizerState);
  for (const std::size_t i : {1, 3, 0, 2}) {  // h[2] used last, then h[0]
    store.acquire(h[i], stream_);
    store.release(h[i], false);
  }
  store.evict_tag(kTagOptimizerState);
  store.prefetch_tag(kTagOptimizerState, stream_);
  EXPECT_TRUE(store.resident(h[2]));
  EXPECT_TRUE(store.resident(h[0]));
  EXPECT_FALSE(store.resident(h[1]));
  EXPECT_FALSE(store.resident(h[3]));
  EXPECT_EQ(store.stats().evictions, 4u) << "a prefetched handle was evicted again";
  backend().stream_synchronize(stream_);
}

TEST_P(TieredStoreTest, StatsJsonHasTheTelemetry) {
  TieredStore store(backend(), options(1 << 20));
  auto h = store.create(1000, kTagOptimizerState);
  store.acquire(h, stream_);
  store.release(h, true);
  store.evict(h);
  store.synchronize();
  const std::string json = store.stats_json();
  for (const char* key : {"\"h2d\":{\"bytes\":1000", "\"d2h\":{\"bytes\":1000", "\"gb_per_s\"",
                          "\"exposed_wait_ms\"", "\"hidden_ms\"", "\"evictions\":1",
                          "\"prefetch_hits\"", "\"misses\":1", "\"pageable_allocs\":0"}) {
    EXPECT_NE(json.find(key), std::string::npos) << key << " missing in " << json;
  }
}

// ---- fault injection ---------------------------------------------------------------------

class TieredStoreFaultTest : public TieredStoreTest {};

TEST_P(TieredStoreFaultTest, FailedLoadKeepsTheHostCopy) {
  TieredStore store(backend(), options(1 << 20));
  const auto [h, data] = create_written(store, 200000, 3);
  backend().inject_fault(FaultPoint::copy, 1);
  EXPECT_THROW(store.acquire(h, stream_), TieringError);
  EXPECT_FALSE(store.resident(h));
  EXPECT_EQ(store.device_bytes(), 0u);
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), data.size()), -1);
  const auto seen = read_device(store.acquire(h, stream_), 200000, stream_);  // works again
  EXPECT_EQ(first_difference(seen.data(), data.data(), data.size()), -1);
  store.release(h, false);
}

TEST_P(TieredStoreFaultTest, FailedCopyBackKeepsTheDeviceCopy) {
  TieredStore store(backend(), options(1 << 20));
  auto h = store.create(200000, kTagOptimizerState);
  const auto data = random_bytes(200000, 4);
  write_device(store.acquire(h, stream_), data);
  store.release(h, true);
  backend().inject_fault(FaultPoint::copy, 1);
  const std::string m = test_support::expect_error<TieringError>([&] { store.evict(h); });
  EXPECT_NE(m.find("device copy is kept"), std::string::npos) << m;
  EXPECT_TRUE(store.resident(h));
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), data.size()), -1);
  store.evict(h);  // the fault is spent
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), data.size()), -1);
}

// A backend query that fails while the store hands back the buffers of finished
// write-backs: the buffers handed back so far leave its list, the rest stay pending, so
// none is freed twice and the next operation works.
TEST_P(TieredStoreFaultTest, AQueryFailingWhileFreeingFreesNoBufferTwice) {
  tiering_test::FailingBackend failing(backend());
  TieredStore store(failing, options(1 << 20));
  constexpr std::size_t n = 100 << 10;
  const auto a = store.create(n, kTagOptimizerState, Tier::device);
  const auto b = store.create(n, kTagOptimizerState, Tier::device);
  const auto [h, data] = create_written(store, n, 6);
  store.evict(a);
  store.evict(b);
  backend().device_synchronize();  // both buffers are ready to be handed back
  failing.fail_calls_to("event_query", 1, /*skip=*/1);  // a's is handed back, b's fails
  // Note [One error type]: the query's BackendError reaches the caller as a TieringError.
  const std::string m =
      test_support::expect_error<TieringError>([&] { store.acquire(h, stream_); });
  EXPECT_NE(m.find("event_query"), std::string::npos) << m;
  EXPECT_EQ(store.device_bytes(), n);  // b's buffer, still pending
  const auto seen = read_device(store.acquire(h, stream_), n, stream_);
  EXPECT_EQ(first_difference(seen.data(), data.data(), n), -1);
  store.release(h, false);
  store.synchronize();
  EXPECT_EQ(store.device_bytes(), n);  // h alone
}

// A load (or a create on the device) that takes over the buffer of a write-back still
// in flight (Note [Loads over write-backs]) and fails before it is queued behind that
// write-back: the buffer goes back to the pending frees, charged until the write-back is
// done, not to the device while the write-back still reads it.
TEST_P(TieredStoreFaultTest, AFailedLoadGivesBackATakenOverBufferOnlyAfterItsWriteBack) {
  constexpr std::size_t n = 100 << 10;
  for (const bool by_create : {false, true}) {
    SCOPED_TRACE(by_create ? "create on the device" : "acquire");
    tiering_test::FailingBackend failing(backend());
    TieredStore store(failing, options(n));  // room for one handle: x's buffer is taken
    const auto [y, y_data] = create_written(store, n, 7);
    const auto x = store.create(n, kTagOptimizerState);
    const auto x_data = random_bytes(n, 8);
    write_device(store.acquire(x, stream_), x_data);
    store.release(x, /*dirty=*/true);
    StreamGate gate;
    StreamGate::OpenOnExit open_on_exit{gate};
    backend().launch_host_func(stream_, &StreamGate::wait, &gate);
    store.evict(x);  // its write-back waits for the gate
    if (by_create) {
      failing.fail_calls_to("stream_wait_event", 1);  // the wait for x's write-back
      EXPECT_THROW(store.create(n, kTagOptimizerState, Tier::device), TieringError);
    } else {
      // The load waits for y's host copy, then for x's write-back: that wait fails.
      failing.fail_calls_to("stream_wait_event", 1, /*skip=*/1);
      EXPECT_THROW(store.acquire(y, stream_), TieringError);
      EXPECT_FALSE(store.resident(y));
    }
    EXPECT_EQ(store.device_bytes(), n);  // x's buffer, still on its way out
    gate.open();
    store.synchronize();
    EXPECT_EQ(store.device_bytes(), 0u);
    EXPECT_EQ(first_difference(contents(store, x).data(), x_data.data(), n), -1);
    const auto seen = read_device(store.acquire(y, stream_), n, stream_);
    EXPECT_EQ(first_difference(seen.data(), y_data.data(), n), -1);
    store.release(y, false);
  }
}

// write() and destroy() wait for the copies that use the host block and drop the dirty
// device copy (Note [Drop the device copy last]). With host waits on events failing for
// good, the operation fails, and the data written through the device pointer must stay
// the latest copy: still handed out by acquire, never replaced by the stale host copy in
// a read (which reports the failure instead), and read back once waits work again.
TEST_P(TieredStoreFaultTest, AFailedEventWaitInWriteOrDestroyKeepsTheDirtyDeviceCopy) {
  constexpr std::size_t n = 100 << 10;
  const auto replacement = random_bytes(n, 41);
  for (const bool by_write : {true, false}) {
    SCOPED_TRACE(by_write ? "write" : "destroy");
    tiering_test::FailingBackend failing(backend());
    TieredStore store(failing, options(1 << 20));
    const auto h = store.create(n, kTagOptimizerState);
    const auto data = random_bytes(n, 40);
    write_device(store.acquire(h, stream_), data);
    store.release(h, /*dirty=*/true);
    failing.fail_calls_to("event_synchronize", 1 << 30);  // every host wait on an event fails
    if (by_write) {
      EXPECT_THROW(store.write(h, replacement.data()), TieringError);
    } else {
      EXPECT_THROW(store.destroy(h), TieringError);
    }
    EXPECT_TRUE(store.resident(h));
    const auto seen = read_device(store.acquire(h, stream_), n, stream_);
    EXPECT_EQ(first_difference(seen.data(), data.data(), n), -1);
    store.release(h, /*dirty=*/false);
    std::vector<unsigned char> out(n);
    EXPECT_THROW(store.read(h, out.data()), TieringError);  // not the stale host copy
    failing.fail_calls_to("event_synchronize", 0);
    EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), n), -1);
    store.evict(h);  // the copy-back still sees the latest data
    EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), n), -1);
    if (by_write) {
      store.write(h, replacement.data());  // waits work again: the write happens
      EXPECT_EQ(first_difference(contents(store, h).data(), replacement.data(), n), -1);
    }
    store.destroy(h);
  }
}

TEST_P(TieredStoreFaultTest, DeviceOutOfMemoryIsAClearErrorAndLosesNothing) {
  TieredStore store(backend(), options(1 << 20));
  const auto [h, data] = create_written(store, 5000, 5);
  backend().inject_fault(FaultPoint::device_alloc, 1);
  const std::string m =
      test_support::expect_error<TieringError>([&] { store.acquire(h, stream_); });
  EXPECT_NE(m.find("out of memory"), std::string::npos) << m;
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), data.size()), -1);
}

TEST_P(TieredStoreFaultTest, RegistrationFailureUsesReportedPageableMemory) {
  TieredStore store(backend(), options(16 << 20));
  backend().inject_fault(FaultPoint::host_register, 1);
  // A direct pinned mapping would be registered.
  auto h = store.create(8 << 20, kTagOptimizerState);
  EXPECT_EQ(store.host_tier(h), HostTier::pageable);
  const TieredStoreStats s = store.stats();
  EXPECT_EQ(s.host.fallback_register_failed, 1u);
  EXPECT_EQ(s.host.pageable_allocs, 1u);
  const auto data = random_bytes(8 << 20, 6);
  store.write(h, data.data());
  store.acquire(h, stream_);
  store.release(h, true);
  store.evict(h);
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), data.size()), -1);
}

TEST_P(TieredStoreFaultTest, ExhaustedHostArenaIsAClearErrorAndKeepsOthers) {
  TieredStoreOptions o = options(64 << 20);
  o.host.pinned_budget_bytes = 16 << 20;
  o.host.allow_pageable_fallback = false;
  TieredStore store(backend(), o);
  const auto [h, data] = create_written(store, 8 << 20, 8);
  const std::string m =
      test_support::expect_error<TieringError>([&] { store.create(12 << 20, kTagOptimizerState); });
  EXPECT_NE(m.find("pinned budget"), std::string::npos) << m;
  EXPECT_EQ(first_difference(contents(store, h).data(), data.data(), data.size()), -1);
}

// Stores built one after another on one caching allocator (what a process that creates
// and destroys optimizers does): each store's copy engine allocates device buffers on its
// own H2D stream, frees them on its D2H stream, and destroys both streams with the store.
// The allocator must never touch those streams again (Note [Stream contract] in
// caching_allocator.h: the store releases them from the allocator before destroying
// them), while the memory they cached keeps serving later stores and other streams.
class TieredStoreOnAllocatorTest : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    std::unique_ptr<Backend> backend;
    if (GetParam() == BackendKind::cuda) {
      if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
      backend = make_cuda_backend(0);
    } else {
      HostBackendOptions o;
      o.capacity_bytes = std::size_t{512} << 20;
      backend = make_host_backend(0, o);
    }
    AllocatorOptions ao;
    ao.map_slot_bytes = 4 << 20;  // small slots: free runs move between streams often
    allocator_ = std::make_unique<CachingAllocator>(std::move(backend), ao);
    stream_ = allocator_->backend().create_stream();
  }
  void TearDown() override {
    if (!allocator_) return;
    allocator_->release_stream(stream_);
    allocator_->backend().destroy_stream(stream_);
  }
  TieredStoreOptions options() const {
    TieredStoreOptions o = tiering_test::test_store_options(12 << 20);
    o.copy.chunk_bytes = 256 << 10;
    return o;
  }
  // One store's life: handles of small and large sizes, acquired, written, released,
  // evicted under budget pressure, read back; then the store is destroyed.
  void run_store(std::uint64_t seed) {
    TieredStore store(allocator_->backend(), options(), caching_allocator_source(*allocator_));
    const std::size_t sizes[] = {64 << 10, 300000, 1536 << 10, 3 << 20, 5 << 20, 700000};
    std::vector<TieredStore::Handle> handles;
    std::vector<std::vector<unsigned char>> data;
    for (std::size_t i = 0; i < std::size(sizes); ++i) {
      const Tier tier = i % 2 == 0 ? Tier::device : Tier::host;
      handles.push_back(store.create(sizes[i], kTagOptimizerState, tier));
      data.push_back(tiering_test::random_bytes(sizes[i], seed + i));
    }
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t i = 0; i < handles.size(); ++i) {
        void* dev = store.acquire(handles[i], stream_);
        allocator_->backend().copy_async(dev, data[i].data(), sizes[i], CopyKind::host_to_device,
                                         stream_);
        allocator_->backend().stream_synchronize(stream_);
        store.release(handles[i], /*dirty=*/true);
        if (i % 3 == 1) store.evict(handles[i]);
      }
    }
    for (std::size_t i = 0; i < handles.size(); ++i) {
      std::vector<unsigned char> out(sizes[i]);
      store.read(handles[i], out.data());
      EXPECT_EQ(first_difference(out.data(), data[i].data(), sizes[i]), -1) << "handle " << i;
    }
    store.destroy(handles[0]);  // the rest die with the store
  }
  std::unique_ptr<CachingAllocator> allocator_;
  Stream stream_;
};

TEST_P(TieredStoreOnAllocatorTest, StoresComeAndGoOnOneAllocator) {
  const int rounds = 4;
  for (int round = 0; round < rounds; ++round) {
    run_store(100 * static_cast<std::uint64_t>(round));
    const AllocatorStats s = allocator_->stats();
    EXPECT_EQ(s.tags[kTagOptimizerState].bytes.current, 0u) << "round " << round;
    EXPECT_EQ(s.allocated.current, 0u) << "round " << round;
    // Traffic on a live stream between stores: large enough that the allocator looks at
    // every stream's free memory (steals, moves free runs, grows).
    std::vector<std::pair<void*, std::size_t>> live;
    for (std::size_t bytes : {std::size_t{24} << 20, std::size_t{3} << 20, std::size_t{40} << 20,
                              std::size_t{512} << 10, std::size_t{9} << 20}) {
      live.emplace_back(allocator_->allocate(bytes, stream_), bytes);
    }
    for (auto [p, bytes] : live) allocator_->deallocate(p, bytes, stream_);
  }
  allocator_->backend().stream_synchronize(stream_);
  allocator_->empty_cache();
  const AllocatorStats s = allocator_->stats();
  EXPECT_EQ(s.allocated.current, 0u);
  EXPECT_EQ(s.reserved.current, 0u) << allocator_->snapshot_json();
}

INSTANTIATE_TEST_SUITE_P(Backends, TieredStoreTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);
#ifndef TIDEPOOL_TIERING_GPU_BUILD  // fault injection exists on the host backend only
INSTANTIATE_TEST_SUITE_P(Host, TieredStoreFaultTest, ::testing::Values(BackendKind::host),
                         tiering_test::backend_name);
#else
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(TieredStoreFaultTest);
#endif
INSTANTIATE_TEST_SUITE_P(Backends, TieredStoreOnAllocatorTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
