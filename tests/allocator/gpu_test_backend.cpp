// The backend battery on the cuda backend (ctest label `gpu`): the same tests the host
// backend passes in test_backend.cpp, run on a real GPU, so the host backend is checked
// against the behaviour it emulates. Without a GPU every test skips itself.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "allocator/backends/copy_split.h"
#include "tests/allocator/backend_test_battery.h"

namespace tidepool::testing {
namespace {

INSTANTIATE_TEST_SUITE_P(Cuda, BackendBattery, ::testing::Values(BackendKind::cuda),
                         backend_param_name);

TEST(CudaBackend, FactoryChecksTheDeviceIndex) {
  const int count = cuda_device_count();
  EXPECT_GE(count, 0);
  EXPECT_THROW(make_cuda_backend(-1), BackendError);
  EXPECT_THROW(make_cuda_backend(count), BackendError);
}

TEST(CudaBackend, IdentifiesItselfAndIgnoresFaultInjection) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto b = make_cuda_backend(0);
  EXPECT_EQ(b->kind(), BackendKind::cuda);
  EXPECT_STREQ(b->name(), "cuda");
  EXPECT_TRUE(built_with_cuda());
  b->inject_fault(FaultPoint::device_alloc);
  void* p = b->device_alloc(1 << 20);
  EXPECT_NE(p, nullptr);
  b->device_free(p, 1 << 20);
}

TEST(CudaBackend, OutOfMemoryIsNullptrAndLeavesNoStickyError) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto b = make_cuda_backend(0);
  const MemInfo info = b->mem_info();
  EXPECT_EQ(b->device_alloc(info.total_bytes * 2), nullptr);
  EXPECT_FALSE(b->create_physical((info.total_bytes * 2) / b->granularity() * b->granularity(),
                                  MemoryLocation::device));
  void* p = b->device_alloc(1 << 20);  // the device still works afterwards
  EXPECT_NE(p, nullptr);
  b->device_free(p, 1 << 20);
}

// Note [Copies across host-NUMA mappings] (cuda_backend.cpp): one copy_async over two
// mappings of different physical allocations, host-NUMA memory on one side or both, lands
// every byte where it belongs, in each direction. On the H200 (2026-12-04) the one VMM test
// whose copies spanned such mappings died of a segmentation fault; these make such copies
// through the seam alone, one kind per test, so that a failure names the kind.
struct SpanCase {
  MemoryLocation first, second;
  CopyKind kind;  // with the mapped range as the destination, or as the source
  bool into_range;
};

std::string span_name(const ::testing::TestParamInfo<SpanCase>& info) {
  auto where = [](MemoryLocation w) { return w == MemoryLocation::host ? "host" : "device"; };
  const SpanCase& c = info.param;
  const char* how = c.kind == CopyKind::device_to_device
                        ? (c.into_range ? "written_from_device" : "read_to_device")
                        : (c.into_range ? "written_from_host" : "read_to_host");
  return std::string(where(c.first)) + "_then_" + where(c.second) + "_" + how;
}

class CudaSpanningCopy : public ::testing::TestWithParam<SpanCase> {};

TEST_P(CudaSpanningCopy, OneCopyOverTwoBackingsMovesEveryByte) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto b = make_cuda_backend(0);
  const SpanCase c = GetParam();
  const std::size_t half = 2 * b->granularity();
  const std::size_t n = 2 * half;
  PhysicalHandle first, second;
  try {
    first = b->create_physical(half, c.first);
    second = b->create_physical(half, c.second);
  } catch (const BackendError& e) {
    if (first) b->release_physical(first, half);
    GTEST_SKIP() << "no host-NUMA physical memory here: " << e.what();
  }
  ASSERT_TRUE(first && second);
  char* va = static_cast<char*>(b->reserve_address(n));
  b->map(va, half, first);
  b->map(va + half, half, second);
  const Stream s = b->create_stream();
  std::vector<unsigned char> data(n), seen(n);
  for (std::size_t i = 0; i < n; ++i) data[i] = static_cast<unsigned char>(i * 131 + 7);
  void* buffer = c.kind == CopyKind::device_to_device ? b->device_alloc(n) : nullptr;

  // The case's copy spans both backings; the copies setting up or checking it take each
  // half alone.
  auto read_halves = [&] {
    b->copy_async(seen.data(), va, half, CopyKind::device_to_host, s);
    b->copy_async(seen.data() + half, va + half, half, CopyKind::device_to_host, s);
  };
  auto write_halves = [&] {
    b->copy_async(va, data.data(), half, CopyKind::host_to_device, s);
    b->copy_async(va + half, data.data() + half, half, CopyKind::host_to_device, s);
  };
  if (c.kind == CopyKind::device_to_device && c.into_range) {
    b->copy_async(buffer, data.data(), n, CopyKind::host_to_device, s);
    b->copy_async(va, buffer, n, CopyKind::device_to_device, s);
    read_halves();
  } else if (c.kind == CopyKind::device_to_device) {
    write_halves();
    b->memset_async(buffer, 0, n, s);
    b->copy_async(buffer, va, n, CopyKind::device_to_device, s);
    b->copy_async(seen.data(), buffer, n, CopyKind::device_to_host, s);
  } else if (c.into_range) {
    b->copy_async(va, data.data(), n, CopyKind::host_to_device, s);
    read_halves();
  } else {
    write_halves();
    b->copy_async(seen.data(), va, n, CopyKind::device_to_host, s);
  }
  b->stream_synchronize(s);
  EXPECT_TRUE(seen == data);

  if (buffer != nullptr) b->device_free(buffer, n);
  b->destroy_stream(s);
  b->unmap(va + half, half);
  b->unmap(va, half);
  b->release_physical(second, half);
  b->release_physical(first, half);
  b->release_address(va, n);
}

// Where the cuda backend cuts a copy (allocator/backends/copy_split.h): a pure function,
// so these run on any machine.
TEST(CudaCopySplit, ACopyIsCutAtEveryEdgeOfAHostNumaMappingOnEitherSide) {
  using backend_detail::copy_piece_ends;
  using Ends = std::vector<std::size_t>;
  const backend_detail::MappingMap none;
  EXPECT_EQ(copy_piece_ends(none, 0x10000, 0x90000, 4096), Ends{4096});
  // Host-NUMA mappings at [0x1000, 0x3000) and [0x3000, 0x4000), another at 0x9000.
  const backend_detail::MappingMap host{{0x1000, 0x2000}, {0x3000, 0x1000}, {0x9000, 0x1000}};
  // Wholly inside one mapping, or outside all of them: one piece.
  EXPECT_EQ(copy_piece_ends(host, 0x1800, 0x50000, 0x800), Ends{0x800});
  EXPECT_EQ(copy_piece_ends(host, 0x20000, 0x50000, 0x5000), Ends{0x5000});
  // Exactly one mapping: its edges are the copy's ends, one piece.
  EXPECT_EQ(copy_piece_ends(host, 0x1000, 0x50000, 0x2000), Ends{0x2000});
  // Across two mappings that touch: cut where one ends and the next starts.
  EXPECT_EQ(copy_piece_ends(host, 0x1000, 0x50000, 0x3000), (Ends{0x2000, 0x3000}));
  // From before the first to past the second (device memory on both sides of them).
  EXPECT_EQ(copy_piece_ends(host, 0x800, 0x50000, 0x4000), (Ends{0x800, 0x2800, 0x3800, 0x4000}));
  // The source side counts too, and an edge both sides share is one cut.
  EXPECT_EQ(copy_piece_ends(host, 0x40000, 0x2000, 0x2000), (Ends{0x1000, 0x2000}));
  EXPECT_EQ(copy_piece_ends(host, 0x2000, 0x2000 + 0x7000, 0x1800),
            (Ends{0x1000, 0x1800}));  // dst crosses 0x3000, src [0x9000, 0xa800) crosses 0xa000
}

constexpr MemoryLocation kHost = MemoryLocation::host;
constexpr MemoryLocation kDevice = MemoryLocation::device;

INSTANTIATE_TEST_SUITE_P(
    Spans, CudaSpanningCopy,
    ::testing::Values(SpanCase{kHost, kHost, CopyKind::host_to_device, true},
                      SpanCase{kHost, kHost, CopyKind::device_to_host, false},
                      SpanCase{kHost, kHost, CopyKind::device_to_device, true},
                      SpanCase{kHost, kHost, CopyKind::device_to_device, false},
                      SpanCase{kDevice, kHost, CopyKind::host_to_device, true},
                      SpanCase{kDevice, kHost, CopyKind::device_to_host, false},
                      SpanCase{kDevice, kHost, CopyKind::device_to_device, true},
                      SpanCase{kDevice, kHost, CopyKind::device_to_device, false},
                      SpanCase{kHost, kDevice, CopyKind::host_to_device, true},
                      SpanCase{kHost, kDevice, CopyKind::device_to_host, false}),
    span_name);

}  // namespace
}  // namespace tidepool::testing
