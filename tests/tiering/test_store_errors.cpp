// TieredStore's errors (Note [One error type] and Note [A failed load's buffer] in
// tiering/): every public operation that fails underneath reaches its caller as a
// TieringError naming the operation, the handle and its bytes, with the underlying cause
// in the message and nested; std::bad_alloc passes through. A load that fails while the
// memory source's deallocate fails too reports the load's own error, and its buffer
// stays charged among the pending frees until a later reap hands it back, exactly once.
// After each failure the store stays usable and no data is lost.
//
// Host backend only: the failures are injected at the seam (tests/tiering/
// failing_backend.h, Backend::inject_fault) and in a test memory source.
#include <atomic>
#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string>
#include <vector>

#include "allocator/errors.h"
#include "allocator/forwarding_backend.h"
#include "allocator/tags.h"
#include "tests/support/backend_errors.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;

constexpr std::size_t kBytes = 100 << 10;

// A memory source over the backend's device memory that fails on demand and checks that
// every buffer is handed back exactly once.
class TestSource {
 public:
  explicit TestSource(Backend& backend) : backend_(backend) {}
  ~TestSource() { EXPECT_TRUE(live_.empty()) << live_.size() << " buffers never handed back"; }

  DeviceMemorySource source() {
    DeviceMemorySource s;
    s.allocate = [this](std::size_t n, Stream) -> void* {
      if (allocate_error != nullptr) std::rethrow_exception(allocate_error);
      void* p = backend_.device_alloc(n);
      std::lock_guard lock(mutex_);
      if (p != nullptr) live_.insert(p);
      return p;
    };
    s.deallocate = [this](void* p, std::size_t n, Stream) {
      if (refuse_deallocate)
        throw BackendError("test source: deallocate refused, nothing given back");
      {
        std::lock_guard lock(mutex_);
        EXPECT_EQ(live_.erase(p), 1u) << "a buffer handed back twice, or never allocated";
      }
      backend_.device_free(p, n);
    };
    return s;
  }
  std::size_t live() const {
    std::lock_guard lock(mutex_);
    return live_.size();
  }

  std::exception_ptr allocate_error;  // non-null: allocate throws it
  bool refuse_deallocate = false;     // deallocate throws BackendError, gives nothing back

 private:
  Backend& backend_;
  mutable std::mutex mutex_;
  std::set<void*> live_;
};

class StoreErrorsTest : public tiering_test::TieringStreamTest {
 protected:
  void SetUp() override {
    TieringStreamTest::SetUp();
    failing_ = std::make_unique<tiering_test::FailingBackend>(backend());
    source_ = std::make_unique<TestSource>(*failing_);
  }
  void TearDown() override {
    store_.reset();
    source_.reset();
    TieringStreamTest::TearDown();
  }
  // A store on the failing backend and the test source, with room for `handles` handles.
  TieredStore& make_store(std::size_t handles = 4) {
    store_ = std::make_unique<TieredStore>(
        *failing_, tiering_test::test_store_options(handles * kBytes), source_->source());
    return *store_;
  }
  // A handle whose host copy holds kBytes random bytes from `seed`.
  TieredStore::Handle create_written(std::uint64_t seed) {
    const auto h = store_->create(kBytes, kTagOptimizerState);
    store_->write(h, random_bytes(kBytes, seed).data());
    return h;
  }
  // A handle acquired, written through its device pointer and released dirty: the only
  // copy of random_bytes(kBytes, seed) is on the device.
  TieredStore::Handle create_dirty(std::uint64_t seed) {
    const auto h = store_->create(kBytes, kTagOptimizerState);
    const auto data = random_bytes(kBytes, seed);
    void* dev = store_->acquire(h, stream_);
    backend().copy_async(dev, data.data(), kBytes, CopyKind::host_to_device, stream_);
    backend().stream_synchronize(stream_);
    store_->release(h, /*dirty=*/true);
    return h;
  }
  bool holds(TieredStore::Handle h, std::uint64_t seed) {
    std::vector<unsigned char> out(kBytes);
    store_->read(h, out.data());
    return first_difference(out.data(), random_bytes(kBytes, seed).data(), kBytes) == -1;
  }
  // The device copy acquire hands out holds random_bytes(kBytes, seed).
  bool acquires(TieredStore::Handle h, std::uint64_t seed) {
    const auto seen = read_device(store_->acquire(h, stream_), kBytes, stream_);
    store_->release(h, /*dirty=*/false);
    return first_difference(seen.data(), random_bytes(kBytes, seed).data(), kBytes) == -1;
  }
  // `fn` throws TieringError whose message names `operation` and contains `cause`.
  void expect_tiering_error(const std::function<void()>& fn, const std::string& operation,
                            const std::string& cause) {
    const std::string m = test_support::expect_error<TieringError>(fn);
    EXPECT_NE(m.find(operation), std::string::npos) << "operation not named: " << m;
    EXPECT_NE(m.find(cause), std::string::npos) << "cause lost: " << m;
  }

  std::unique_ptr<tiering_test::FailingBackend> failing_;
  std::unique_ptr<TestSource> source_;
  std::unique_ptr<TieredStore> store_;
};

// ---- Note [A failed load's buffer] ---------------------------------------------------------

// The load's copy fails, then handing its buffer back fails too: the caller sees the
// copy's error, not the deallocate's, and the buffer stays charged until a reap hands it
// back once deallocate works again.
TEST_P(StoreErrorsTest, AFailedLoadWhoseBufferCannotBeHandedBackReportsTheLoadsError) {
  TieredStore& store = make_store();
  const auto h = create_written(1);
  backend().inject_fault(FaultPoint::copy, 1);
  source_->refuse_deallocate = true;
  expect_tiering_error([&] { store.acquire(h, stream_); }, "acquire of handle " + std::to_string(h),
                       "injected fault: copy");
  EXPECT_FALSE(store.resident(h));
  EXPECT_EQ(store.device_bytes(), kBytes);  // not handed back: still the store's, charged
  EXPECT_EQ(source_->live(), 1u);
  EXPECT_THROW(store.synchronize(), TieringError);  // the reap retries: refused again
  EXPECT_EQ(store.device_bytes(), kBytes);
  source_->refuse_deallocate = false;
  store.synchronize();
  EXPECT_EQ(store.device_bytes(), 0u);
  EXPECT_EQ(source_->live(), 0u);  // handed back once (TestSource checks "not twice")
  EXPECT_TRUE(holds(h, 1));
  EXPECT_TRUE(acquires(h, 1));
  EXPECT_EQ(store.device_bytes(), kBytes);
}

// The same on create(Tier::device), whose memset fails: the memset's error reaches the
// caller, and nothing of the handle is left but the charged buffer, handed back later.
TEST_P(StoreErrorsTest, AFailedCreateOnTheDeviceWhoseBufferCannotBeHandedBackReportsItsError) {
  TieredStore& store = make_store();
  failing_->fail_calls_to("memset_async", 1);
  source_->refuse_deallocate = true;
  expect_tiering_error([&] { store.create(kBytes, kTagOptimizerState, Tier::device); },
                       "create of " + std::to_string(kBytes) + " bytes", "memset_async");
  EXPECT_EQ(store.stats().handles, 0u);
  EXPECT_EQ(store.device_bytes(), kBytes);
  source_->refuse_deallocate = false;
  store.synchronize();
  EXPECT_EQ(store.device_bytes(), 0u);
  EXPECT_EQ(source_->live(), 0u);
  const auto h = store.create(kBytes, kTagOptimizerState, Tier::device);  // works again
  EXPECT_EQ(store.device_bytes(), kBytes);
  std::vector<unsigned char> out(kBytes, 1);
  store.read(h, out.data());
  EXPECT_EQ(first_difference(out.data(), std::vector<unsigned char>(kBytes, 0).data(), kBytes), -1);
}

// The H2D stream cannot even be synchronized after the failed copy: a copy may still
// write the buffer, so it is not handed back now; it waits among the pending frees
// behind an event on the H2D stream, and the copy's error is what the caller sees.
TEST_P(StoreErrorsTest, AFailedLoadWhoseStreamCannotBeSynchronizedKeepsItsBufferPending) {
  TieredStore& store = make_store();
  const auto h = create_written(2);
  backend().inject_fault(FaultPoint::copy, 1);
  failing_->fail_calls_to("stream_synchronize", 1);
  expect_tiering_error([&] { store.acquire(h, stream_); }, "acquire", "injected fault: copy");
  EXPECT_EQ(store.device_bytes(), kBytes);
  store.synchronize();
  EXPECT_EQ(store.device_bytes(), 0u);
  EXPECT_EQ(source_->live(), 0u);
  EXPECT_TRUE(acquires(h, 2));
}

// ---- Note [One error type] -----------------------------------------------------------------

// The memory source's allocate throws (a backend failure in the caching allocator): create
// on the device, acquire and prefetch report it as TieringError with its message, and the
// original is nested.
TEST_P(StoreErrorsTest, AnAllocateThatThrowsIsATieringErrorWithItsCause) {
  TieredStore& store = make_store();
  const auto h = create_written(3);
  source_->allocate_error = std::make_exception_ptr(BackendError("test source: allocate broke"));
  const std::string handle =
      "of handle " + std::to_string(h) + " (" + std::to_string(kBytes) + " bytes)";
  expect_tiering_error([&] { store.acquire(h, stream_); }, "acquire " + handle, "allocate broke");
  expect_tiering_error([&] { store.prefetch(h, stream_); }, "prefetch " + handle, "allocate broke");
  expect_tiering_error([&] { store.prefetch_tag(kTagOptimizerState, stream_); },
                       "prefetch_tag " + handle, "allocate broke");
  expect_tiering_error([&] { store.create(kBytes, kTagOptimizerState, Tier::device); },
                       "create of " + std::to_string(kBytes) + " bytes on the device",
                       "allocate broke");
  try {
    store.acquire(h, stream_);
    ADD_FAILURE() << "acquire did not throw";
  } catch (const TieringError& e) {
    EXPECT_THROW(std::rethrow_if_nested(e), BackendError);
  }
  EXPECT_EQ(store.stats().handles, 1u);
  EXPECT_EQ(store.stats().acquired_handles, 0u);
  source_->allocate_error = nullptr;
  EXPECT_TRUE(acquires(h, 3));
  EXPECT_TRUE(holds(h, 3));
}

// Host memory running out (std::bad_alloc, OutOfMemoryError among them) stays itself:
// the C ABIs report it as out of memory (allocator/c_api_guard.h).
TEST_P(StoreErrorsTest, OutOfMemoryPassesThroughUnwrapped) {
  TieredStore& store = make_store();
  const auto h = create_written(4);
  source_->allocate_error = std::make_exception_ptr(OutOfMemoryError("test source: no memory"));
  EXPECT_THROW(store.acquire(h, stream_), OutOfMemoryError);
  source_->allocate_error = nullptr;
  EXPECT_TRUE(acquires(h, 4));
}

// A deallocate that throws while an acquire makes room (reaping the buffers of finished
// write-backs): a TieringError naming the acquire, with the deallocate's message.
TEST_P(StoreErrorsTest, ADeallocateThatThrowsWhileMakingRoomIsATieringError) {
  TieredStore& store = make_store(/*handles=*/1);
  const auto a = create_dirty(5);
  const auto b = create_written(6);
  store.evict(a);  // a's buffer is on its way out
  backend().device_synchronize();
  source_->refuse_deallocate = true;
  expect_tiering_error([&] { store.acquire(b, stream_); }, "acquire of handle " + std::to_string(b),
                       "deallocate refused");
  EXPECT_EQ(store.device_bytes(), kBytes);  // a's buffer, still pending
  source_->refuse_deallocate = false;
  EXPECT_TRUE(acquires(b, 6));
  EXPECT_TRUE(holds(a, 5));
  EXPECT_TRUE(holds(b, 6));
}

// A backend call that fails inside evict, evict_tag, read, write, destroy and
// synchronize: each reaches the caller as a TieringError naming it and the failed call,
// and the latest contents stay readable once the backend works again.
TEST_P(StoreErrorsTest, EveryOperationReportsABackendFailureAsATieringError) {
  TieredStore& store = make_store();
  const auto h = create_dirty(7);
  const std::string of_h = " of handle " + std::to_string(h);
  failing_->fail_calls_to("stream_wait_event", 1);  // the copy-back's wait for the load
  expect_tiering_error([&] { store.evict(h); }, "evict" + of_h, "stream_wait_event");
  EXPECT_TRUE(store.resident(h));
  failing_->fail_calls_to("stream_wait_event", 1);
  expect_tiering_error([&] { store.evict_tag(kTagOptimizerState); }, "evict_tag" + of_h,
                       "stream_wait_event");
  EXPECT_TRUE(store.resident(h));
  failing_->fail_calls_to("event_synchronize", 1);  // write's wait for the copy-back
  expect_tiering_error([&] { store.write(h, random_bytes(kBytes, 8).data()); }, "write" + of_h,
                       "event_synchronize");
  failing_->fail_calls_to("event_synchronize", 1);
  expect_tiering_error([&] { store.destroy(h); }, "destroy" + of_h, "event_synchronize");
  failing_->fail_calls_to("copy_async", 1);  // read copies the dirty device copy
  std::vector<unsigned char> out(kBytes);
  expect_tiering_error([&] { store.read(h, out.data()); }, "read" + of_h, "copy_async");
  EXPECT_TRUE(holds(h, 7));
  store.evict(h);
  failing_->fail_calls_to("event_synchronize", 1);  // read waits for the copy-back
  expect_tiering_error([&] { store.read(h, out.data()); }, "read" + of_h, "event_synchronize");
  failing_->fail_calls_to("stream_synchronize", 1);  // synchronize waits for the copies
  expect_tiering_error([&] { store.synchronize(); }, "synchronize", "stream_synchronize");
  store.synchronize();
  EXPECT_EQ(store.device_bytes(), 0u);
  EXPECT_TRUE(holds(h, 7));
  EXPECT_TRUE(acquires(h, 7));
  store.destroy(h);
  EXPECT_EQ(store.stats().handles, 0u);
}

// Note [Reclaim never throws]: a reclaim (an allocator's out-of-memory path) whose second
// eviction fails still returns what the first freed, instead of throwing out of the walk
// over the device's stores; the handle that failed keeps its device copy.
TEST_P(StoreErrorsTest, AReclaimWhoseEvictionFailsReturnsWhatItFreed) {
  TieredStore& store = make_store();
  const auto a = create_dirty(11);
  const auto b = create_dirty(12);
  const auto c = create_dirty(13);
  const long waits_before = failing_->calls_to("stream_wait_event");
  store.evict(c);
  store.synchronize();
  const long waits_per_eviction = failing_->calls_to("stream_wait_event") - waits_before;
  ASSERT_GT(waits_per_eviction, 0);
  failing_->fail_calls_to("stream_wait_event", 1, static_cast<int>(waits_per_eviction));
  std::size_t freed = 0;
  EXPECT_NO_THROW(freed = store.reclaim(2 * kBytes));
  EXPECT_EQ(freed, kBytes);  // a, least recently acquired; b's eviction failed
  EXPECT_EQ(store.stats().reclaim_failures, 1u);
  EXPECT_EQ(store.stats().reclaimed_bytes, kBytes);
  EXPECT_FALSE(store.resident(a));
  EXPECT_TRUE(store.resident(b));
  EXPECT_EQ(store.device_bytes(), kBytes);
  EXPECT_TRUE(holds(a, 11));
  EXPECT_TRUE(holds(b, 12));
  EXPECT_TRUE(holds(c, 13));
  EXPECT_NE(store.stats_json().find("\"reclaim_failures\":1"), std::string::npos);
}

// An eviction whose wait on a use stream fails gives the event it recorded for that wait
// back: every event the store created is destroyed with it.
TEST_P(StoreErrorsTest, AFailedWaitOnAUseStreamLeaksNoEvent) {
  TieredStore& store = make_store();
  const auto h = create_dirty(14);  // released dirty: stream_ is a use stream of h
  failing_->fail_calls_to("stream_wait_event", 1);  // evict's wait on stream_'s event
  expect_tiering_error([&] { store.evict(h); }, "evict", "stream_wait_event");
  store.evict(h);
  EXPECT_TRUE(holds(h, 14));
  store.synchronize();
  store_.reset();
  EXPECT_EQ(failing_->calls_to("create_event"), failing_->calls_to("destroy_event"));
}

// Note [A whole memory source] (tiering/memory_source.cpp): a source with allocate or deallocate
// but not both, or with only the optional fields, is refused with an error naming what is
// missing, before the store creates anything (no copy stream). Completed with the
// backend's functions, a stream-ordered one had its buffers freed by device_free while
// their write-backs still read them.
TEST_P(StoreErrorsTest, APartlyFilledMemorySourceIsRefusedNamingWhatIsMissing) {
  DeviceMemorySource no_deallocate = source_->source();
  no_deallocate.deallocate = nullptr;
  no_deallocate.stream_ordered = true;
  DeviceMemorySource no_allocate = source_->source();
  no_allocate.allocate = nullptr;
  DeviceMemorySource only_optional;
  only_optional.try_allocate = [](std::size_t, Stream) -> void* { return nullptr; };
  only_optional.stream_ordered = true;
  const struct {
    DeviceMemorySource source;
    std::string missing;
  } cases[] = {{no_deallocate, "deallocate"},
               {no_allocate, "allocate"},
               {only_optional, "allocate and deallocate"}};
  for (const auto& c : cases) {
    SCOPED_TRACE("missing " + c.missing);
    const long streams_before = failing_->calls_to("create_stream");
    const std::string m = test_support::expect_error<TieringError>([&] {
      TieredStore store(*failing_, tiering_test::test_store_options(4 * kBytes), c.source);
    });
    EXPECT_NE(m.find("memory source has no " + c.missing + ":"), std::string::npos) << m;
    EXPECT_EQ(failing_->calls_to("create_stream"), streams_before) << "created before refused";
  }
  EXPECT_EQ(source_->live(), 0u);
  // Nothing set is the backend's memory, and both set the caller's: both are taken.
  EXPECT_NO_THROW(TieredStore(*failing_, tiering_test::test_store_options(kBytes)));
  EXPECT_NO_THROW(
      TieredStore(*failing_, tiering_test::test_store_options(kBytes), source_->source()));
}

// Events lost on the way out of a failed call (store_events.cpp: every event a store takes
// goes back to its pool, also when the call fails). Each failure is injected into a fresh
// store, whose pool holds few events, and every event created through the backend must
// be destroyed with the store: calls to create_event less the failed ones equal the
// calls to destroy_event.
class EventLeaksTest : public StoreErrorsTest {
 protected:
  void expect_no_event_leaked() {
    const long alive = failing_->calls_to("create_event") - failed_creations_ -
                       failing_->calls_to("destroy_event");
    EXPECT_EQ(alive, leaked_) << "an event created and never destroyed";
    leaked_ = alive;  // each leak reported once, by the failure that made it
  }
  long failed_creations_ = 0;  // create_event calls that failed, creating nothing
  long leaked_ = 0;
};

// Whichever event creation of a read fails (the use events, its completion `done`, the
// copy engine's timing event), the events it took before go back to the pool. The
// handle is used by several streams, so that the read records several use events and
// takes `done` after them from an empty pool.
TEST_P(EventLeaksTest, AFailedEventCreationInAReadLeaksNoEvent) {
  constexpr int kUsers = 4;
  std::vector<Stream> users;
  for (int i = 0; i < kUsers; ++i) users.push_back(backend().create_stream());
  long creations = -1;  // a read's event creations, from the run where none fails
  for (long failing = -1; failing == -1 || failing < creations; ++failing) {
    SCOPED_TRACE("failing creation " + std::to_string(failing));
    TieredStore& store = make_store();
    const auto h = create_dirty(15);  // its device copy is the latest: read copies from it
    for (Stream s : users) store.acquire(h, s);
    for (int i = 0; i < kUsers; ++i) store.release(h, /*dirty=*/false);
    std::vector<unsigned char> out(kBytes);
    if (failing < 0) {
      const long before = failing_->calls_to("create_event");
      store.read(h, out.data());
      creations = failing_->calls_to("create_event") - before;
    } else {
      const long failed_before = failing_->failed_calls();  // only creations fail here
      failing_->fail_calls_to("create_event", 1, static_cast<int>(failing));
      expect_tiering_error([&] { store.read(h, out.data()); }, "read", "create_event");
      failing_->fail_calls_to("create_event", 0);
      failed_creations_ += failing_->failed_calls() - failed_before;
    }
    EXPECT_TRUE(holds(h, 15));
    store.synchronize();
    store_.reset();
    expect_no_event_leaked();
  }
  EXPECT_GE(creations, kUsers) << "the read took its events from the pool: nothing was tested";
  for (Stream s : users) backend().destroy_stream(s);
}

// Whichever record an eviction of a dirty handle makes fails (the use stream's event, the
// copy engine's timing event, the copy-back's completion, the event its buffer is freed
// after), the event it took goes back to the pool, and the handle keeps its device copy.
TEST_P(EventLeaksTest, AFailedRecordInAnEvictionLeaksNoEvent) {
  long records = -1;  // an eviction's records, from the run where none fails
  for (long failing = -1; failing == -1 || failing < records; ++failing) {
    SCOPED_TRACE("failing record " + std::to_string(failing));
    TieredStore& store = make_store();
    const auto h = create_dirty(16);
    if (failing < 0) {
      const long before = failing_->calls_to("record_event");
      store.evict(h);
      records = failing_->calls_to("record_event") - before;
    } else {
      failing_->fail_calls_to("record_event", 1, static_cast<int>(failing));
      expect_tiering_error([&] { store.evict(h); }, "evict", "record_event");
      failing_->fail_calls_to("record_event", 0);
      EXPECT_TRUE(store.resident(h));
    }
    EXPECT_TRUE(holds(h, 16));
    store.synchronize();
    store_.reset();
    expect_no_event_leaked();
  }
  EXPECT_GE(records, 4) << "fewer records than an eviction makes: nothing was tested";
}

// Review finding: a clean eviction was counted before the record that can still fail, so
// a failed evict (the handle stays resident) counted one; and a destroy or a write, which
// throw the device copy's contents away, counted as (clean) evictions.
TEST_P(StoreErrorsTest, OnlyAnEvictionThatHappenedCountsAsOne) {
  TieredStore& store = make_store();
  const auto probe = create_written(30);
  ASSERT_TRUE(acquires(probe, 30));
  const long before = failing_->calls_to("record_event");
  store.evict(probe);
  const long records = failing_->calls_to("record_event") - before;
  ASSERT_GE(records, 1);
  ASSERT_EQ(store.stats().evictions, 1u);
  ASSERT_EQ(store.stats().evictions_clean, 1u);

  const auto clean = create_written(31);
  ASSERT_TRUE(acquires(clean, 31));
  failing_->fail_calls_to("record_event", 1, static_cast<int>(records - 1));  // the last
  expect_tiering_error([&] { store.evict(clean); }, "evict", "record_event");
  failing_->fail_calls_to("record_event", 0);
  EXPECT_TRUE(store.resident(clean));
  EXPECT_EQ(store.stats().evictions, 1u);
  EXPECT_EQ(store.stats().evictions_clean, 1u);

  const auto dirty = create_dirty(32);
  store.write(clean, random_bytes(kBytes, 33).data());  // resident: its device copy dropped
  store.destroy(dirty);
  EXPECT_EQ(store.stats().evictions, 1u);
  EXPECT_EQ(store.stats().evictions_clean, 1u);
  EXPECT_TRUE(holds(clean, 33));
  EXPECT_TRUE(acquires(clean, 33));
}

// release makes no backend call; its errors are the store's own checks, TieringError.
// Throws std::bad_alloc from the copy_async that copies_until_throw counts down to.
class ThrowsInACopy : public ForwardingBackend {
 public:
  explicit ThrowsInACopy(Backend& inner) : ForwardingBackend(inner) {}
  std::atomic<int> copies_until_throw{0};  // 0: never

 protected:
  void on_call(Call call) override {
    if (call == Call::copy_async && copies_until_throw.fetch_sub(1) == 1) throw std::bad_alloc();
  }
};

// Review finding: a copy back that failed part-way with anything but a BackendError (a
// std::bad_alloc) left the chunks it had enqueued in flight, uncovered by host_ready: a
// destroy then freed the host block they were still writing into. The eviction now waits
// for them before the error goes on, and the handle keeps its device copy.
TEST_P(StoreErrorsTest, ACopyBackThatThrowsPartWayWaitsForTheChunksItEnqueued) {
  ThrowsInACopy thrower(backend());
  TieredStore store(thrower, tiering_test::small_chunk_store_options(8 * kBytes));
  const auto h = store.create(kBytes, kTagOptimizerState);
  store.write(h, random_bytes(kBytes, 3).data());
  const auto newer = random_bytes(kBytes, 4);
  void* dev = store.acquire(h, stream_);
  backend().copy_async(dev, newer.data(), kBytes, CopyKind::host_to_device, stream_);
  store.release(h, /*dirty=*/true);
  // The copy back's chunks wait behind the user stream, held until the gate opens.
  tiering_test::StreamGate gate;
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
  backend().launch_host_func(stream_, &tiering_test::StreamGate::wait, &gate);
  thrower.copies_until_throw = 2;  // the first 64 KiB chunk is enqueued, the second throws
  auto evict = std::async(std::launch::async, [&] { store.evict(h); });
  // Not a timing bound: an eviction that ends while its first chunk is held is the failure.
  EXPECT_EQ(evict.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the failed copy back did not wait for the chunk it had enqueued";
  gate.open();
  EXPECT_THROW(evict.get(), std::bad_alloc);
  EXPECT_TRUE(store.resident(h)) << "the device copy is the latest: kept";
  std::vector<unsigned char> back(kBytes);
  store.read(h, back.data());
  EXPECT_EQ(first_difference(back.data(), newer.data(), kBytes), -1);
  store.destroy(h);
}

TEST_P(StoreErrorsTest, ReleaseErrorsAreTieringErrors) {
  TieredStore& store = make_store();
  const auto h = create_written(9);
  expect_tiering_error([&] { store.release(h, false); }, "release", "not acquired");
  expect_tiering_error([&] { store.release(h + 100, false); }, "release", "unknown handle");
  EXPECT_TRUE(acquires(h, 9));
}

// ---- a failed acquire counts nothing (Entry::uncounted_load in tiered_store.cpp) ------------

// An acquire whose wait fails, after its handle was prefetched or after it loaded the
// handle itself, counts neither a prefetch hit nor a miss; the retry that succeeds
// counts the load, once.
TEST_P(StoreErrorsTest, AFailedAcquireCountsNoHitOrMissAndItsRetryCountsOnce) {
  TieredStore& store = make_store();
  // How many stream waits an acquire that loads makes: its last is the acquire's own.
  const auto probe = create_written(20);
  const long waits_before = failing_->calls_to("stream_wait_event");
  EXPECT_TRUE(acquires(probe, 20));
  const long waits_per_loading_acquire = failing_->calls_to("stream_wait_event") - waits_before;
  ASSERT_GT(waits_per_loading_acquire, 0);
  const TieredStoreStats start = store.stats();
  ASSERT_EQ(start.misses, 1u);

  const auto prefetched = create_written(21);
  store.prefetch(prefetched, stream_);
  failing_->fail_calls_to("stream_wait_event", 1);  // the acquire's wait for the copy
  expect_tiering_error([&] { store.acquire(prefetched, stream_); }, "acquire", "stream_wait_event");
  EXPECT_EQ(store.stats().prefetch_hits, start.prefetch_hits);
  EXPECT_EQ(store.stats().misses, start.misses);
  EXPECT_TRUE(acquires(prefetched, 21));
  EXPECT_EQ(store.stats().prefetch_hits, start.prefetch_hits + 1);
  EXPECT_EQ(store.stats().misses, start.misses);

  const auto loaded = create_written(22);
  failing_->fail_calls_to("stream_wait_event", 1, static_cast<int>(waits_per_loading_acquire - 1));
  expect_tiering_error([&] { store.acquire(loaded, stream_); }, "acquire", "stream_wait_event");
  EXPECT_TRUE(store.resident(loaded));  // the load went through; its acquire did not
  EXPECT_EQ(store.stats().prefetch_hits, start.prefetch_hits + 1);
  EXPECT_EQ(store.stats().misses, start.misses);
  EXPECT_TRUE(acquires(loaded, 22));
  EXPECT_EQ(store.stats().prefetch_hits, start.prefetch_hits + 1);
  EXPECT_EQ(store.stats().misses, start.misses + 1);
  EXPECT_EQ(store.stats().acquires, 3u);
}

// Note [A failed acquire to overwrite]: whichever of its stream waits fails, an
// acquire_to_overwrite of a handle on the host leaves it there, its host copy the latest
// (not resident with a buffer that never received the data, called clean).
TEST_P(StoreErrorsTest, AFailedAcquireToOverwriteLeavesTheHandleOnTheHost) {
  TieredStore& store = make_store();
  const auto probe = create_written(29);
  const long waits_before = failing_->calls_to("stream_wait_event");
  (void)store.acquire_to_overwrite(probe, stream_);  // on the host: its load is skipped
  store.release(probe, /*dirty=*/false);
  const long waits = failing_->calls_to("stream_wait_event") - waits_before;
  ASSERT_GT(waits, 0);
  for (int failing_wait = 0; failing_wait < waits; ++failing_wait) {
    SCOPED_TRACE("failing wait " + std::to_string(failing_wait));
    const auto h = create_written(30 + static_cast<std::uint64_t>(failing_wait));
    const TieredStoreStats before = store.stats();
    failing_->fail_calls_to("stream_wait_event", 1, failing_wait);
    expect_tiering_error([&] { (void)store.acquire_to_overwrite(h, stream_); }, "acquire",
                         "stream_wait_event");
    failing_->fail_calls_to("stream_wait_event", 0);
    EXPECT_FALSE(store.resident(h));
    EXPECT_EQ(store.stats().acquires, before.acquires);
    EXPECT_EQ(store.stats().loads_skipped, before.loads_skipped) << "a failed acquire counted";
    EXPECT_TRUE(holds(h, 30 + static_cast<std::uint64_t>(failing_wait)));
    EXPECT_TRUE(acquires(h, 30 + static_cast<std::uint64_t>(failing_wait)));
    store.destroy(h);
  }
}

INSTANTIATE_TEST_SUITE_P(Host, StoreErrorsTest, ::testing::Values(BackendKind::host),
                         tiering_test::backend_name);
INSTANTIATE_TEST_SUITE_P(Host, EventLeaksTest, ::testing::Values(BackendKind::host),
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
