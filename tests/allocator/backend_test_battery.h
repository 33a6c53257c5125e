// The backend seam's test battery: what every Backend must do, whatever it runs on.
//
// Included by test_backend.cpp (instantiated on the host backend, always runs) and by
// gpu_test_backend.cpp (instantiated on the cuda backend, label `gpu`, skipped without a
// GPU), so the host backend is held to exactly the behaviour the GPU shows. Everything
// is observed through the seam itself: device memory is only read back by copies, and
// host buffers are page-aligned and host_register'ed so CUDA copies are truly async.
//
// Ordering tests use a Gate: a host function that blocks its stream until the test opens
// it. While it is closed, what must wait for it cannot have happened in a correct backend;
// the test then gives a broken one some time (stays_incomplete) to show it runs early.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "allocator/backend.h"
#include "tests/support/stream_gate.h"
#include "tests/support/test_scale.h"

namespace tidepool {
// How gtest prints the parameter (found by ADL): "host" / "cuda", not a byte dump.
inline void PrintTo(BackendKind kind, std::ostream* out) {
  *out << (kind == BackendKind::cuda ? "cuda" : "host");
}
}  // namespace tidepool

namespace tidepool::testing {


using Gate = test_support::StreamGate;

inline void increment_counter(void* counter) {
  static_cast<std::atomic<int>*>(counter)->fetch_add(1);
}

inline void sleep_5ms(void*) { std::this_thread::sleep_for(std::chrono::milliseconds(5)); }

// True if `e` is still incomplete after polling it for `ms` milliseconds. A correct
// backend holds the event back for ever (a gate blocks it); the polling only gives an
// incorrect one the time to run ahead and be caught.
inline bool stays_incomplete(Backend& b, Event e, int ms = 30) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (std::chrono::steady_clock::now() < until) {
    if (b.event_query(e)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return !b.event_query(e);
}

// Builds the backend named by the test parameter and cleans up after each test, even one
// that failed half-way: gates are opened and streams drained before anything is freed.
class BackendBattery : public ::testing::TestWithParam<BackendKind> {
 protected:
  void SetUp() override {
    if (GetParam() == BackendKind::cuda) {
      if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
      backend_ = make_cuda_backend(0);
    } else {
      backend_ = make_host_backend(0);
    }
  }

  void TearDown() override {
    if (!backend_) return;
    for (auto& gate : gates_) gate.open();
    backend_->device_synchronize();
    for (Stream s : streams_) backend_->destroy_stream(s);
    for (Event e : events_) backend_->destroy_event(e);
    for (auto& [ptr, bytes] : device_buffers_) backend_->device_free(ptr, bytes);
    for (void* ptr : host_buffers_) {
      backend_->host_unregister(ptr);
      std::free(ptr);
    }
    backend_.reset();
  }

  Backend& backend() { return *backend_; }
  Gate& new_gate() { return gates_.emplace_back(); }
  Stream new_stream() { return streams_.emplace_back(backend_->create_stream()); }
  Event new_event() { return events_.emplace_back(backend_->create_event()); }
  std::byte* device_buffer(std::size_t bytes) {
    void* ptr = backend_->device_alloc(bytes);
    EXPECT_NE(ptr, nullptr) << "device_alloc(" << bytes << ")";
    if (ptr != nullptr) device_buffers_.emplace_back(ptr, bytes);
    return static_cast<std::byte*>(ptr);
  }
  // Page-aligned, registered (pinned) host memory, filled with `fill`.
  std::byte* host_buffer(std::size_t bytes, int fill = 0) {
    const std::size_t page = 4096;
    const std::size_t rounded = (bytes + page - 1) / page * page;
    void* ptr = std::aligned_alloc(page, rounded);
    std::memset(ptr, fill, rounded);
    backend_->host_register(ptr, rounded);
    host_buffers_.push_back(ptr);
    return static_cast<std::byte*>(ptr);
  }
  // Copies `bytes` of device memory at `src` to a fresh host buffer and waits for it.
  std::vector<unsigned char> read_back(const void* src, std::size_t bytes, Stream s = {}) {
    std::byte* host = host_buffer(bytes);
    backend_->copy_async(host, src, bytes, CopyKind::device_to_host, s);
    backend_->stream_synchronize(s);
    return std::vector<unsigned char>(reinterpret_cast<unsigned char*>(host),
                                      reinterpret_cast<unsigned char*>(host) + bytes);
  }

  static void fill_pattern(std::byte* p, std::size_t bytes, unsigned seed) {
    for (std::size_t i = 0; i < bytes; ++i) p[i] = static_cast<std::byte>((i * 131 + seed) & 0xff);
  }
  static bool has_pattern(const std::vector<unsigned char>& v, unsigned seed) {
    for (std::size_t i = 0; i < v.size(); ++i)
      if (v[i] != static_cast<unsigned char>((i * 131 + seed) & 0xff)) return false;
    return true;
  }
  static bool all_equal(const std::vector<unsigned char>& v, unsigned char value) {
    for (unsigned char c : v)
      if (c != value) return false;
    return true;
  }

  std::unique_ptr<Backend> backend_;

 private:
  std::deque<Gate> gates_;  // deque: gates never move, streams hold pointers to them
  std::vector<Stream> streams_;
  std::vector<Event> events_;
  std::vector<std::pair<void*, std::size_t>> device_buffers_;
  std::vector<void*> host_buffers_;
};

inline std::string backend_param_name(const ::testing::TestParamInfo<BackendKind>& info) {
  return info.param == BackendKind::cuda ? "cuda" : "host";
}

// --- device memory ----------------------------------------------------------------------

TEST_P(BackendBattery, AllocReturnsAlignedWritableMemory) {
  const std::size_t bytes = (std::size_t{1} << 20) + 100;
  std::byte* dev = device_buffer(bytes);
  ASSERT_NE(dev, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(dev) % 256, 0u);
  std::byte* src = host_buffer(bytes);
  fill_pattern(src, bytes, 7);
  backend().copy_async(dev, src, bytes, CopyKind::host_to_device, {});
  EXPECT_TRUE(has_pattern(read_back(dev, bytes), 7));
}

TEST_P(BackendBattery, MemInfoIsConsistent) {
  const MemInfo info = backend().mem_info();
  EXPECT_GT(info.total_bytes, 0u);
  EXPECT_LE(info.free_bytes, info.total_bytes);
  EXPECT_EQ(backend().granularity() % (std::size_t{2} << 20), 0u);
}

// --- streams and events -----------------------------------------------------------------

struct OrderRecorder {
  std::mutex mutex;
  std::vector<int> order;
};
struct OrderStep {
  OrderRecorder* recorder;
  int index;
  static void run(void* self) {
    auto* step = static_cast<OrderStep*>(self);
    std::lock_guard lock(step->recorder->mutex);
    step->recorder->order.push_back(step->index);
  }
};

TEST_P(BackendBattery, StreamRunsWorkInFifoOrder) {
  for (Stream s : {Stream{}, new_stream()}) {
    OrderRecorder recorder;
    std::vector<OrderStep> steps;
    for (int i = 0; i < 64; ++i) steps.push_back({&recorder, i});
    Gate& gate = new_gate();
    backend().launch_host_func(s, &Gate::wait, &gate);  // nothing may run before this
    for (auto& step : steps) backend().launch_host_func(s, &OrderStep::run, &step);
    {
      std::lock_guard lock(recorder.mutex);
      EXPECT_TRUE(recorder.order.empty()) << "work ran past a blocked host function";
    }
    gate.open();
    backend().stream_synchronize(s);
    std::vector<int> expected;
    for (int i = 0; i < 64; ++i) expected.push_back(i);
    EXPECT_EQ(recorder.order, expected);
  }
}

TEST_P(BackendBattery, WorkIsAsynchronousAndSynchronizeWaits) {
  Stream s = new_stream();
  Gate& gate = new_gate();
  std::atomic<int> counter{0};
  backend().launch_host_func(s, &Gate::wait, &gate);
  backend().launch_host_func(s, &increment_counter, &counter);
  Event done = new_event();
  backend().record_event(done, s);
  EXPECT_FALSE(backend().event_query(done));
  EXPECT_EQ(counter.load(), 0);
  gate.open();
  backend().stream_synchronize(s);
  EXPECT_EQ(counter.load(), 1);
  EXPECT_TRUE(backend().event_query(done));
}

TEST_P(BackendBattery, NeverRecordedEventIsComplete) {
  Event e = new_event();
  EXPECT_TRUE(backend().event_query(e));
  backend().event_synchronize(e);  // returns at once
}

TEST_P(BackendBattery, EventOrdersWorkAcrossStreams) {
  const std::size_t bytes = 64 << 10;
  Stream producer = new_stream();
  Stream consumer = new_stream();
  std::byte* dev = device_buffer(bytes);
  backend().memset_async(dev, 0, bytes, {});  // what an early consumer would read
  backend().stream_synchronize({});
  std::byte* src = host_buffer(bytes);
  std::byte* dst = host_buffer(bytes, 0x5a);
  Gate& gate = new_gate();
  // The producer is blocked until the gate opens; only then does it write the pattern.
  backend().launch_host_func(producer, &Gate::wait, &gate);
  fill_pattern(src, bytes, 3);
  backend().copy_async(dev, src, bytes, CopyKind::host_to_device, producer);
  Event produced = new_event();
  backend().record_event(produced, producer);
  backend().stream_wait_event(consumer, produced);
  backend().copy_async(dst, dev, bytes, CopyKind::device_to_host, consumer);
  Event consumed = new_event();
  backend().record_event(consumed, consumer);
  EXPECT_FALSE(backend().event_query(produced));
  EXPECT_TRUE(stays_incomplete(backend(), consumed)) << "consumer ran before the producer's event";
  gate.open();
  backend().stream_synchronize(consumer);
  EXPECT_TRUE(backend().event_query(produced));
  std::vector<unsigned char> seen(reinterpret_cast<unsigned char*>(dst),
                                  reinterpret_cast<unsigned char*>(dst) + bytes);
  EXPECT_TRUE(has_pattern(seen, 3));
}

TEST_P(BackendBattery, WaitUsesTheRecordAtCallTimeAndRerecordReplaces) {
  Stream blocked = new_stream();
  Stream idle = new_stream();
  Stream waiter = new_stream();
  Gate& gate = new_gate();
  Gate& waiter_gate = new_gate();
  backend().launch_host_func(blocked, &Gate::wait, &gate);
  Event e = new_event();
  backend().record_event(e, blocked);
  // The waiter reaches its wait only after the re-record below; it must still wait for
  // the record on `blocked` that was current when stream_wait_event was called.
  backend().launch_host_func(waiter, &Gate::wait, &waiter_gate);
  backend().stream_wait_event(waiter, e);
  std::atomic<int> counter{0};
  backend().launch_host_func(waiter, &increment_counter, &counter);
  Event waiter_done = new_event();
  backend().record_event(waiter_done, waiter);
  // Re-record on an idle stream: the event completes, but the earlier wait must not.
  backend().record_event(e, idle);
  backend().event_synchronize(e);
  EXPECT_TRUE(backend().event_query(e));
  waiter_gate.open();
  EXPECT_TRUE(stays_incomplete(backend(), waiter_done));
  EXPECT_EQ(counter.load(), 0);
  gate.open();
  backend().stream_synchronize(waiter);
  EXPECT_EQ(counter.load(), 1);
}

TEST_P(BackendBattery, ElapsedTimeCoversTheWorkBetweenEvents) {
  Stream s = new_stream();
  Event start = new_event();
  Event end = new_event();
  backend().record_event(start, s);
  backend().launch_host_func(s, &sleep_5ms, nullptr);
  backend().record_event(end, s);
  backend().event_synchronize(end);
  const float ms = backend().event_elapsed_ms(start, end);
  EXPECT_GE(ms, 4.0f);
  EXPECT_LT(ms, 10000.0f);
  Event unrecorded = new_event();
  EXPECT_THROW(backend().event_elapsed_ms(start, unrecorded), BackendError);
}

TEST_P(BackendBattery, DeviceSynchronizeDrainsEveryStream) {
  std::atomic<int> counter{0};
  std::vector<Stream> streams{Stream{}, new_stream(), new_stream()};
  for (int round = 0; round < 8; ++round)
    for (Stream s : streams) backend().launch_host_func(s, &increment_counter, &counter);
  backend().device_synchronize();
  EXPECT_EQ(counter.load(), 24);
}

TEST_P(BackendBattery, DestroyStreamDrainsItFirst) {
  Stream s = backend().create_stream();
  std::atomic<int> counter{0};
  backend().launch_host_func(s, &sleep_5ms, nullptr);
  backend().launch_host_func(s, &increment_counter, &counter);
  backend().destroy_stream(s);
  EXPECT_EQ(counter.load(), 1);
}

// --- copies -----------------------------------------------------------------------------

TEST_P(BackendBattery, CopiesOfEveryKindCopy) {
  const std::size_t bytes = 300000;  // not a multiple of anything in particular
  Stream s = new_stream();
  std::byte* h1 = host_buffer(bytes);
  std::byte* h2 = host_buffer(bytes);
  std::byte* d1 = device_buffer(bytes);
  std::byte* d2 = device_buffer(bytes);
  fill_pattern(h1, bytes, 11);
  backend().copy_async(d1, h1, bytes, CopyKind::host_to_device, s);
  backend().copy_async(d2, d1, bytes, CopyKind::device_to_device, s);
  backend().copy_async(h2, h1, bytes, CopyKind::host_to_host, s);
  backend().stream_synchronize(s);
  std::vector<unsigned char> h2_seen(reinterpret_cast<unsigned char*>(h2),
                                     reinterpret_cast<unsigned char*>(h2) + bytes);
  EXPECT_TRUE(has_pattern(h2_seen, 11)) << "host_to_host";
  EXPECT_TRUE(has_pattern(read_back(d2, bytes, s), 11)) << "host_to_device + device_to_device";
  // A zero-byte copy is a no-op, as with cudaMemcpyAsync.
  backend().copy_async(d2, h2, 0, CopyKind::host_to_device, s);
  backend().stream_synchronize(s);
}

TEST_P(BackendBattery, MemsetFillsBytes) {
  const std::size_t bytes = 100000;
  std::byte* dev = device_buffer(bytes);
  backend().memset_async(dev, 0xab, bytes, {});
  backend().memset_async(dev + 10, 0x01, 20, {});
  std::vector<unsigned char> seen = read_back(dev, bytes);
  for (std::size_t i = 0; i < bytes; ++i) {
    const unsigned char want = (i >= 10 && i < 30) ? 0x01 : 0xab;
    ASSERT_EQ(seen[i], want) << "byte " << i;
  }
}

// --- device memory limit ---------------------------------------------------------------

// set_device_limit (the memory fraction): device_alloc and device physical memory count
// against it together and get out-of-memory beyond it; host physical memory does not;
// what is given back counts again; lifting it restores the device's own limit.
TEST_P(BackendBattery, DeviceLimitBindsDeviceAllocationsTogether) {
  const std::size_t g = backend().granularity();
  ASSERT_EQ(backend().device_limit(), SIZE_MAX);
  const std::size_t before = backend().device_bytes_in_use();
  backend().set_device_limit(before + 3 * g);
  void* a = backend().device_alloc(2 * g);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(backend().device_bytes_in_use(), before + 2 * g);
  EXPECT_EQ(backend().device_alloc(2 * g), nullptr) << "over the limit: out of memory";
  PhysicalHandle dev = backend().create_physical(g, MemoryLocation::device);
  ASSERT_TRUE(dev) << "exactly up to the limit";
  EXPECT_FALSE(backend().create_physical(g, MemoryLocation::device));
  PhysicalHandle host = backend().create_physical(g, MemoryLocation::host);
  EXPECT_TRUE(host) << "host memory is not device memory";
  EXPECT_EQ(backend().device_bytes_in_use(), before + 3 * g);
  backend().release_physical(dev, g);
  backend().release_physical(host, g);
  EXPECT_EQ(backend().device_bytes_in_use(), before + 2 * g);
  void* b = backend().device_alloc(g);
  EXPECT_NE(b, nullptr) << "given back, counted again";
  backend().device_free(a, 2 * g);
  backend().device_free(b, g);
  EXPECT_EQ(backend().device_bytes_in_use(), before);
  backend().set_device_limit(SIZE_MAX);
  void* c = backend().device_alloc(8 * g);
  EXPECT_NE(c, nullptr);
  backend().device_free(c, 8 * g);
}

// --- virtual address ranges -------------------------------------------------------------

// The tiering layer's pointer-stable migration: data written through a VA survives
// unmap, follows its physical handle to another VA, and moves to a new physical handle of
// the other location under the same VA.
TEST_P(BackendBattery, RemappingKeepsDataAndPointers) {
  const std::size_t g = backend().granularity();
  std::byte* va = static_cast<std::byte*>(backend().reserve_address(2 * g));
  ASSERT_NE(va, nullptr);
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(va) % g, 0u);
  PhysicalHandle dev_phys = backend().create_physical(g, MemoryLocation::device);
  ASSERT_TRUE(dev_phys);
  backend().map(va, g, dev_phys);
  std::byte* src = host_buffer(g);
  fill_pattern(src, g, 42);
  backend().copy_async(va, src, g, CopyKind::host_to_device, {});
  backend().stream_synchronize({});
  backend().unmap(va, g);

  // The same handle at another VA: same bytes.
  backend().map(va + g, g, dev_phys);
  EXPECT_TRUE(has_pattern(read_back(va + g, g), 42));

  // Migrate to host backing, keeping the pointer va + g.
  std::byte* staging = static_cast<std::byte*>(backend().reserve_address(g));
  PhysicalHandle host_phys = backend().create_physical(g, MemoryLocation::host);
  ASSERT_TRUE(host_phys);
  backend().map(staging, g, host_phys);
  backend().copy_async(staging, va + g, g, CopyKind::device_to_device, {});
  backend().stream_synchronize({});
  backend().unmap(staging, g);
  backend().unmap(va + g, g);
  backend().release_physical(dev_phys, g);
  backend().map(va + g, g, host_phys);
  EXPECT_TRUE(has_pattern(read_back(va + g, g), 42)) << "after migration to host backing";

  // And back to the first VA, remapped in place.
  backend().unmap(va + g, g);
  backend().map(va, g, host_phys);
  EXPECT_TRUE(has_pattern(read_back(va, g), 42));
  backend().unmap(va, g);
  backend().release_physical(host_phys, g);
  backend().release_address(staging, g);
  backend().release_address(va, 2 * g);
}

// --- bad input: every precondition is a clear error ----------------------------------

TEST_P(BackendBattery, BadInputIsAClearError) {
  Backend& b = backend();
  const std::size_t g = b.granularity();
  EXPECT_THROW(b.device_alloc(0), BackendError);
  EXPECT_THROW(b.device_free(nullptr, 16), BackendError);
  EXPECT_THROW(b.destroy_stream(Stream{}), BackendError);
  EXPECT_THROW(b.record_event(Event{}, Stream{}), BackendError);
  EXPECT_THROW(b.event_query(Event{}), BackendError);
  EXPECT_THROW(b.event_synchronize(Event{}), BackendError);
  EXPECT_THROW(b.stream_wait_event(Stream{}, Event{}), BackendError);
  EXPECT_THROW(b.destroy_event(Event{}), BackendError);
  std::byte* h = host_buffer(4096);
  EXPECT_THROW(b.copy_async(nullptr, h, 16, CopyKind::host_to_host, {}), BackendError);
  EXPECT_THROW(b.copy_async(h, nullptr, 16, CopyKind::host_to_host, {}), BackendError);
  EXPECT_THROW(b.copy_async(h + 8, h, 16, CopyKind::host_to_host, {}), BackendError)
      << "overlapping ranges";
  EXPECT_THROW(b.memset_async(nullptr, 0, 16, {}), BackendError);
  EXPECT_THROW(b.launch_host_func({}, nullptr, nullptr), BackendError);
  EXPECT_THROW(b.host_register(nullptr, 4096), BackendError);
  EXPECT_THROW(b.host_register(h + 1, 4095), BackendError) << "not page-aligned";
  EXPECT_THROW(b.host_unregister(nullptr), BackendError);
  EXPECT_THROW(b.reserve_address(0), BackendError);
  EXPECT_THROW(b.reserve_address(g + 4096), BackendError);
  EXPECT_THROW(b.create_physical(0, MemoryLocation::device), BackendError);
  EXPECT_THROW(b.create_physical(g / 2, MemoryLocation::device), BackendError);
  EXPECT_THROW(b.release_physical(PhysicalHandle{}, g), BackendError);

  std::byte* va = static_cast<std::byte*>(b.reserve_address(2 * g));
  PhysicalHandle phys = b.create_physical(g, MemoryLocation::device);
  ASSERT_TRUE(phys);
  EXPECT_THROW(b.map(va + 4096, g, phys), BackendError) << "misaligned va";
  EXPECT_THROW(b.map(va, g + 4096, phys), BackendError) << "misaligned size";
  EXPECT_THROW(b.map(va, g, PhysicalHandle{}), BackendError);
  EXPECT_THROW(b.map(nullptr, g, phys), BackendError);
  EXPECT_THROW(b.unmap(va + 1, g), BackendError);
  EXPECT_THROW(b.release_address(va, 0), BackendError);
  // Nothing above corrupted anything: the range still maps and holds data.
  b.map(va, g, phys);
  b.memset_async(va, 0x3c, g, {});
  EXPECT_TRUE(all_equal(read_back(va, g), 0x3c));
  b.unmap(va, g);
  b.release_physical(phys, g);
  b.release_address(va, 2 * g);
}

// --- concurrency ------------------------------------------------------------------------

// Several threads enqueue on shared streams at once, ordering their own work across
// streams with events; run under TSan in CI.
TEST_P(BackendBattery, ConcurrentThreadsOnSharedStreams) {
  constexpr int kThreads = 4;
  const auto iterations = test_support::scaled(40);
  const std::size_t region = 16 << 10;
  std::vector<Stream> streams{Stream{}, new_stream(), new_stream()};
  std::byte* dev = device_buffer(region * kThreads);
  std::vector<std::byte*> host;
  std::vector<Event> events;
  for (int t = 0; t < kThreads; ++t) {
    host.push_back(host_buffer(region));
    events.push_back(new_event());
  }
  std::atomic<int> host_funcs{0};
  std::atomic<int> mismatches{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Backend& b = backend();
      std::byte* mine = dev + t * region;
      for (int i = 0; i < iterations; ++i) {
        const int value = (t * 31 + i) & 0xff;
        const Stream producer = streams[(t + i) % streams.size()];
        const Stream consumer = streams[(t + i + 1) % streams.size()];
        b.memset_async(mine, value, region, producer);
        b.record_event(events[t], producer);
        b.stream_wait_event(consumer, events[t]);
        b.copy_async(host[t], mine, region, CopyKind::device_to_host, consumer);
        b.launch_host_func(consumer, &increment_counter, &host_funcs);
        b.stream_synchronize(consumer);
        for (std::size_t k = 0; k < region; k += 512)
          if (static_cast<int>(host[t][k]) != value) mismatches.fetch_add(1);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  backend().device_synchronize();
  EXPECT_EQ(mismatches.load(), 0);
  EXPECT_EQ(host_funcs.load(), kThreads * iterations);
}

TEST_P(BackendBattery, ConcurrentMappingFromManyThreads) {
  constexpr int kThreads = 4;
  const auto iterations = test_support::scaled(5);
  const std::size_t g = backend().granularity();
  std::atomic<int> failures{0};
  std::atomic<int> wrong_bytes{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Backend& b = backend();
      Stream s = b.create_stream();
      for (int i = 0; i < iterations; ++i) {
        void* va = b.reserve_address(g);
        PhysicalHandle phys = b.create_physical(g, MemoryLocation::device);
        if (!phys) {
          failures.fetch_add(1);
          b.release_address(va, g);
          continue;
        }
        b.map(va, g, phys);
        // A fill of this thread and iteration, read back through the mapping: a map that
        // landed on another thread's backing, or none, shows as other bytes.
        const int fill = (t * 61 + i) % 255 + 1;
        b.memset_async(va, fill, 4096, s);
        Event e = b.create_event();
        b.record_event(e, s);
        b.event_synchronize(e);
        b.destroy_event(e);
        std::vector<unsigned char> back(4096);
        b.copy_async(back.data(), va, back.size(), CopyKind::device_to_host, s);
        b.stream_synchronize(s);
        if (std::any_of(back.begin(), back.end(), [&](unsigned char c) { return c != fill; })) {
          wrong_bytes.fetch_add(1);
        }
        b.unmap(va, g);
        b.release_physical(phys, g);
        b.release_address(va, g);
      }
      b.destroy_stream(s);
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(wrong_bytes.load(), 0) << "a mapping read back other bytes than were written";
}

}  // namespace tidepool::testing
