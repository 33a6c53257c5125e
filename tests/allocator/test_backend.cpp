// Tests of the backend seam on the host backend: the shared battery (which the cuda
// backend also passes, see gpu_test_backend.cpp), plus what only the host backend can
// show deterministically: the capacity limit, fault injection at every point, and its
// validation of pointers, handles and ranges against its own records.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "tests/allocator/backend_test_battery.h"
#include "tests/support/backend_errors.h"
#include "tests/support/stream_gate.h"

namespace tidepool::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Host, BackendBattery, ::testing::Values(BackendKind::host),
                         backend_param_name);

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::unique_ptr<Backend> small_host_backend(std::size_t capacity) {
  HostBackendOptions options;
  options.capacity_bytes = capacity;
  return make_host_backend(0, options);
}

using test_support::error_of;

// The set-up of the VA tests: a host backend, its granularity, one granule of address
// space reserved, and a physical handle of one granule in `where`, not mapped yet.
struct ReservedGranule {
  std::unique_ptr<Backend> backend;
  std::size_t granularity;
  void* va;
  PhysicalHandle handle;
};
ReservedGranule reserve_granule(MemoryLocation where) {
  ReservedGranule r{make_host_backend(), 0, nullptr, {}};
  r.granularity = r.backend->granularity();
  r.va = r.backend->reserve_address(r.granularity);
  r.handle = r.backend->create_physical(r.granularity, where);
  return r;
}

// How the VA tests end: `va` unmapped, then `handle` and the reservation released, in the
// order the backend requires.
void unmap_and_release(Backend& b, void* va, std::size_t bytes, PhysicalHandle handle) {
  b.unmap(va, bytes);
  b.release_physical(handle, bytes);
  b.release_address(va, bytes);
}

TEST(HostBackend, IdentifiesItself) {
  auto b = make_host_backend(3);
  EXPECT_EQ(b->kind(), BackendKind::host);
  EXPECT_EQ(b->device(), 3);
  EXPECT_STREQ(b->name(), "host");
  EXPECT_EQ(b->granularity(), 2 * kMiB);
  EXPECT_THROW(make_host_backend(-1), BackendError);
}

TEST(HostBackend, CapacityIsSharedByAllocationsAndDevicePhysicalMemory) {
  auto b = small_host_backend(8 * kMiB);
  EXPECT_EQ(b->mem_info().total_bytes, 8 * kMiB);
  EXPECT_EQ(b->mem_info().free_bytes, 8 * kMiB);
  void* a = b->device_alloc(5 * kMiB);
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(b->mem_info().free_bytes, 3 * kMiB);
  EXPECT_EQ(b->device_alloc(4 * kMiB), nullptr) << "over capacity must be nullptr, not a throw";
  PhysicalHandle p = b->create_physical(2 * kMiB, MemoryLocation::device);
  ASSERT_TRUE(p);
  EXPECT_EQ(b->mem_info().free_bytes, 1 * kMiB);
  EXPECT_FALSE(b->create_physical(2 * kMiB, MemoryLocation::device)) << "over capacity";
  // Host-located physical memory does not count against the device.
  PhysicalHandle h = b->create_physical(4 * kMiB, MemoryLocation::host);
  ASSERT_TRUE(h);
  EXPECT_EQ(b->mem_info().free_bytes, 1 * kMiB);
  // Absurd sizes are an OOM, not a crash.
  EXPECT_EQ(b->device_alloc(~std::size_t{0}), nullptr);
  b->release_physical(p, 2 * kMiB);
  b->release_physical(h, 4 * kMiB);
  b->device_free(a, 5 * kMiB);
  EXPECT_EQ(b->mem_info().free_bytes, 8 * kMiB);
  void* whole = b->device_alloc(8 * kMiB);
  EXPECT_NE(whole, nullptr) << "capacity fully returned";
  b->device_free(whole, 8 * kMiB);
}

TEST(HostBackend, BadFreesAreErrorsAndCorruptNothing) {
  auto b = small_host_backend(8 * kMiB);
  void* a = b->device_alloc(kMiB);
  ASSERT_NE(a, nullptr);
  int local = 0;
  EXPECT_NE(error_of([&] { b->device_free(&local, 4); }).find("not allocated"), std::string::npos);
  EXPECT_NE(error_of([&] { b->device_free(a, 2 * kMiB); }).find("freed with"), std::string::npos);
  EXPECT_EQ(b->mem_info().free_bytes, 7 * kMiB);
  b->device_free(a, kMiB);
  EXPECT_THROW(b->device_free(a, kMiB), BackendError) << "double free";
  EXPECT_EQ(b->mem_info().free_bytes, 8 * kMiB);
}

TEST(HostBackend, UnknownHandlesAreErrors) {
  auto b = make_host_backend();
  auto other = make_host_backend();
  Stream foreign = other->create_stream();
  EXPECT_NE(error_of([&] { b->stream_synchronize(foreign); }).find("unknown stream"),
            std::string::npos);
  Stream s = b->create_stream();
  b->destroy_stream(s);
  EXPECT_THROW(b->stream_synchronize(s), BackendError) << "destroyed stream";
  EXPECT_THROW(b->destroy_stream(s), BackendError);
  Event e = b->create_event();
  b->destroy_event(e);
  EXPECT_THROW(b->event_query(e), BackendError) << "destroyed event";
  EXPECT_THROW(b->release_physical(PhysicalHandle{12345}, 2 * kMiB), BackendError);
  other->destroy_stream(foreign);
}

// --- fault injection --------------------------------------------------------------------

TEST(HostBackend, FaultAtDeviceAllocIsAnOom) {
  auto b = small_host_backend(8 * kMiB);
  b->inject_fault(FaultPoint::device_alloc, 2);
  EXPECT_EQ(b->device_alloc(kMiB), nullptr);
  EXPECT_EQ(b->device_alloc(kMiB), nullptr);
  EXPECT_EQ(b->mem_info().free_bytes, 8 * kMiB) << "a failed allocation takes no capacity";
  void* a = b->device_alloc(kMiB);
  EXPECT_NE(a, nullptr) << "only the injected number of operations fail";
  b->device_free(a, kMiB);
}

TEST(HostBackend, FaultAtCopyThrowsAtEnqueueAndCopiesNothing) {
  auto b = make_host_backend();
  std::vector<char> src(4096, 'x');
  std::vector<char> dst(4096, '.');
  b->inject_fault(FaultPoint::copy);
  EXPECT_THROW(b->copy_async(dst.data(), src.data(), 4096, CopyKind::host_to_host, {}),
               BackendError);
  b->stream_synchronize({});
  EXPECT_EQ(dst, std::vector<char>(4096, '.'));
  b->copy_async(dst.data(), src.data(), 4096, CopyKind::host_to_host, {});
  b->stream_synchronize({});
  EXPECT_EQ(dst, src);
}

TEST(HostBackend, FaultAtHostRegisterThrows) {
  auto b = make_host_backend();
  void* page = std::aligned_alloc(4096, 4096);
  b->inject_fault(FaultPoint::host_register);
  EXPECT_NE(error_of([&] { b->host_register(page, 4096); }).find("injected"), std::string::npos);
  b->host_register(page, 4096);  // not left half-registered
  b->host_unregister(page);
  std::free(page);
}

TEST(HostBackend, FaultAtMapThrowsAndLeavesTheRangeUnmapped) {
  auto [b, g, va, p] = reserve_granule(MemoryLocation::device);
  b->inject_fault(FaultPoint::map);
  EXPECT_THROW(b->map(va, g, p), BackendError);
  EXPECT_THROW(b->unmap(va, g), BackendError) << "nothing was mapped";
  b->map(va, g, p);
  unmap_and_release(*b, va, g, p);
}

TEST(HostBackend, FaultAtCreatePhysicalIsAnOom) {
  auto b = small_host_backend(8 * kMiB);
  b->inject_fault(FaultPoint::create_physical);
  EXPECT_FALSE(b->create_physical(2 * kMiB, MemoryLocation::device));
  EXPECT_EQ(b->mem_info().free_bytes, 8 * kMiB);
  PhysicalHandle p = b->create_physical(2 * kMiB, MemoryLocation::device);
  EXPECT_TRUE(p);
  b->release_physical(p, 2 * kMiB);
}

TEST(HostBackend, InjectFaultRejectsBadArguments) {
  auto b = make_host_backend();
  EXPECT_THROW(b->inject_fault(FaultPoint::count_), BackendError);
  EXPECT_THROW(b->inject_fault(FaultPoint::copy, -1), BackendError);
}

// --- pinned registrations ---------------------------------------------------------------

TEST(HostBackend, RegistrationsMustNotOverlap) {
  auto b = make_host_backend();
  auto* block = static_cast<char*>(std::aligned_alloc(4096, 4 * 4096));
  b->host_register(block + 4096, 2 * 4096);
  EXPECT_THROW(b->host_register(block + 4096, 4096), BackendError) << "double registration";
  EXPECT_THROW(b->host_register(block, 2 * 4096), BackendError) << "overlaps from below";
  EXPECT_THROW(b->host_register(block + 2 * 4096, 2 * 4096), BackendError) << "from above";
  b->host_register(block, 4096);  // adjacent, not overlapping
  b->host_register(block + 3 * 4096, 4096);
  EXPECT_THROW(b->host_unregister(block + 2 * 4096), BackendError) << "not a range start";
  b->host_unregister(block);
  b->host_unregister(block + 4096);
  b->host_unregister(block + 3 * 4096);
  EXPECT_THROW(b->host_unregister(block), BackendError) << "already unregistered";
  std::free(block);
}

// --- VA ranges: host-visible aliasing and range validation -------------------------------

TEST(HostBackend, PhysicalMemoryIsSharedBetweenItsMappings) {
  auto [b, g, first_va, p] = reserve_granule(MemoryLocation::host);
  auto* a = static_cast<char*>(first_va);
  auto* c = static_cast<char*>(b->reserve_address(g));
  b->map(a, g, p);
  b->map(c, g, p);
  std::strcpy(a + 1000, "tidepool");
  EXPECT_STREQ(c + 1000, "tidepool") << "both VAs show the same physical bytes";
  b->unmap(c, g);
  unmap_and_release(*b, a, g, p);
  b->release_address(c, g);
}

TEST(HostBackend, UnmappedRangeStaysReservedAndInaccessible) {
  auto [b, g, va, p] = reserve_granule(MemoryLocation::device);
  b->map(va, g, p);
  b->unmap(va, g);
  // mincore fails with ENOMEM on unmapped addresses; a reservation is still mapped.
  unsigned char residency = 0;
  EXPECT_EQ(::mincore(va, 4096, &residency), 0) << "the reservation survived unmap";
  b->map(va, g, p);  // and can be mapped again
  unmap_and_release(*b, va, g, p);
}

TEST(HostBackend, RangeValidation) {
  auto b = make_host_backend();
  const std::size_t g = b->granularity();
  auto* va = static_cast<char*>(b->reserve_address(2 * g));
  PhysicalHandle small = b->create_physical(g, MemoryLocation::device);
  PhysicalHandle big = b->create_physical(2 * g, MemoryLocation::device);
  EXPECT_NE(error_of([&] { b->map(va + 2 * g, g, small); }).find("not inside"), std::string::npos)
      << "past the reservation";
  EXPECT_THROW(b->map(va, 2 * g, small), BackendError) << "more than the handle holds";
  b->map(va, g, small);
  EXPECT_NE(error_of([&] { b->map(va, g, big); }).find("already mapped"), std::string::npos);
  EXPECT_THROW(b->release_address(va, 2 * g), BackendError) << "still mapped";
  EXPECT_THROW(b->release_address(va, g), BackendError) << "not the reserved size";
  EXPECT_THROW(b->release_physical(small, 2 * g), BackendError) << "wrong size";
  EXPECT_THROW(b->unmap(va + g, g), BackendError) << "nothing mapped there";
  b->unmap(va, g);
  b->map(va, 2 * g, big);
  EXPECT_THROW(b->unmap(va, g), BackendError) << "part of a mapping";
  EXPECT_THROW(b->unmap(va + g, g), BackendError) << "starts inside a mapping";
  b->unmap(va, 2 * g);
  // Two mappings can be unmapped by one call covering both.
  b->map(va, g, small);
  b->release_physical(big, 2 * g);
  PhysicalHandle second = b->create_physical(g, MemoryLocation::device);
  b->map(va + g, g, second);
  b->unmap(va, 2 * g);
  b->release_physical(small, g);
  b->release_physical(second, g);
  b->release_address(va, 2 * g);
}

// --- stream errors ----------------------------------------------------------------------

void throw_from_host_func(void*) { throw std::runtime_error("callback exploded"); }

TEST(HostBackend, ExceptionInHostFuncIsReportedBySynchronize) {
  auto b = make_host_backend();
  Stream s = b->create_stream();
  std::atomic<int> counter{0};
  b->launch_host_func(s, &throw_from_host_func, nullptr);
  b->launch_host_func(s, &increment_counter, &counter);
  EXPECT_NE(error_of([&] { b->stream_synchronize(s); }).find("callback exploded"),
            std::string::npos);
  EXPECT_EQ(counter.load(), 1) << "the stream keeps running after a failed closure";
  b->stream_synchronize(s);  // reported once
  b->destroy_stream(s);
}

struct SelfSync {
  Backend* backend;
  Stream stream;
  std::string error;
  static void run(void* self) {
    auto* me = static_cast<SelfSync*>(self);
    try {
      me->backend->stream_synchronize(me->stream);
    } catch (const BackendError& e) {
      me->error = e.what();
    }
  }
};

TEST(HostBackend, SynchronizingAStreamFromItsOwnHostFuncIsAnError) {
  auto b = make_host_backend();
  Stream s = b->create_stream();
  SelfSync self{b.get(), s, ""};
  b->launch_host_func(s, &SelfSync::run, &self);
  b->stream_synchronize(s);
  EXPECT_NE(self.error.find("wait for itself"), std::string::npos) << self.error;
  b->destroy_stream(s);
}

// As with cudaStreamDestroy, a destroyed stream's handle is dead at once while its queued
// work still runs, and device_synchronize waits for that work (the allocator's free after
// a lost stream depends on it). While one thread is still inside destroy_stream, another
// thread's device_synchronize must not return before the work is done.
TEST(HostBackend, DeviceSynchronizeWaitsForAStreamBeingDestroyed) {
  auto b = make_host_backend();
  Stream s = b->create_stream();
  test_support::StreamGate gate;
  const test_support::StreamGate::OpenOnExit open_on_exit{gate};
  std::atomic<int> work_done{0};
  b->launch_host_func(s, &test_support::StreamGate::wait, &gate);
  b->launch_host_func(s, &increment_counter, &work_done);
  std::thread destroyer([&] { b->destroy_stream(s); });
  test_support::wait_until_stream_handle_is_dead(*b, s);
  std::atomic<int> work_done_at_return{-1};
  std::thread synchronizer([&] {
    b->device_synchronize();
    work_done_at_return = work_done.load();
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  gate.open();
  synchronizer.join();
  destroyer.join();
  EXPECT_EQ(work_done_at_return.load(), 1);
}

TEST(HostBackend, CudaFactoryFailsClearlyWithoutAGpu) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "a GPU is present";
  EXPECT_THROW(make_cuda_backend(0), BackendError);
}

}  // namespace
}  // namespace tidepool::testing
