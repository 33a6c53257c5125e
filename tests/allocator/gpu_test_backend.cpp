// The backend battery on the cuda backend (ctest label `gpu`): the same tests the host
// backend passes in test_backend.cpp, run on a real GPU, so the host backend is checked
// against the behaviour it emulates. Without a GPU every test skips itself.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace tidepool::testing
