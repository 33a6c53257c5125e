// Peer access to mapped ranges on real GPUs (ctest label `gpu`; Note [Peer access to
// mapped ranges] in allocator/backend.h): a range mapped on device 0 is readable by a copy
// running on device 1 once device 1 was granted access, and a range mapped afterwards is
// granted too. Needs two CUDA devices that can reach each other; skips otherwise. (The
// bookkeeping on the host backend: test_peer_access.cpp.)
#include <gtest/gtest.h>

#include <cstddef>
#include <vector>

#include "allocator/backend.h"

namespace tidepool {
namespace {

TEST(CudaPeerAccess, ADeviceGrantedAccessCopiesFromAnothersMappedRange) {
  if (cuda_device_count() < 2) GTEST_SKIP() << "needs two CUDA devices";
  auto owner = make_cuda_backend(0);
  if (!cuda_can_access_peer(0, 1)) {
    EXPECT_THROW(owner->enable_peer_access(1), BackendError);
    GTEST_SKIP() << "device 1 cannot access device 0 (no peer-to-peer path)";
  }
  auto reader = make_cuda_backend(1);
  const std::size_t g = owner->granularity();
  auto* va = static_cast<std::byte*>(owner->reserve_address(2 * g));
  const PhysicalHandle first = owner->create_physical(g, MemoryLocation::device);
  const PhysicalHandle second = owner->create_physical(g, MemoryLocation::device);
  ASSERT_TRUE(first && second);
  owner->map(va, g, first);
  std::vector<unsigned char> pattern(g);
  for (std::size_t i = 0; i < g; ++i) pattern[i] = static_cast<unsigned char>(i * 7 + 3);
  owner->copy_async(va, pattern.data(), g, CopyKind::host_to_device, {});
  owner->stream_synchronize({});
  EXPECT_FALSE(owner->peer_has_access(va, 1));

  owner->enable_peer_access(1);
  EXPECT_TRUE(owner->peer_has_access(va, 1));
  owner->map(va + g, g, second);
  EXPECT_TRUE(owner->peer_has_access(va + g, 1)) << "a range mapped after the grant";

  // A copy enqueued on device 1 reads device 0's mapped range.
  void* dst = reader->device_alloc(g);
  ASSERT_NE(dst, nullptr);
  reader->copy_async(dst, va, g, CopyKind::device_to_device, {});
  reader->stream_synchronize({});
  std::vector<unsigned char> back(g);
  reader->copy_async(back.data(), dst, g, CopyKind::device_to_host, {});
  reader->stream_synchronize({});
  EXPECT_EQ(back, pattern);

  reader->device_free(dst, g);
  owner->unmap(va, 2 * g);
  owner->release_physical(first, g);
  owner->release_physical(second, g);
  owner->release_address(va, 2 * g);
}

}  // namespace
}  // namespace tidepool
