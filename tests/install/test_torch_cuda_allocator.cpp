// tidepool as c10's CUDA allocator (optimizers/install/torch_cuda_allocator.h), without a
// GPU: the hooks the plain pluggable allocator raises for or drops answer from tidepool
// (here over the host backend), both on the allocator object and through c10's own entry
// points once it is installed; installing twice is harmless. The CUDA memory paths
// (malloc, record_stream) are in gpu_test_torch_install.cpp.
#include <gtest/gtest.h>

#if TIDEPOOL_HAVE_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <string>

#include "allocator/c_api.h"
#include "optimizers/install/torch_cuda_allocator.h"

namespace tidepool::optim {
namespace {

class TorchCudaAllocatorTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ASSERT_EQ(tidepool_set_backend("host"), 0) << tidepool_last_error(); }

  static tidepool_stats_v1 stats() {
    tidepool_stats_v1 s{};
    s.struct_size = sizeof s;
    EXPECT_EQ(tidepool_get_stats_v1(0, &s), 0) << tidepool_last_error();
    return s;
  }
  // A freed 8 MiB block: cached memory, and a peak above the current allocation.
  static void cache_a_block() {
    constexpr std::size_t kBlock = std::size_t{8} << 20;
    void* p = tidepool_malloc(kBlock, 0, nullptr);
    ASSERT_NE(p, nullptr) << tidepool_last_error();
    tidepool_free(p, kBlock, 0, nullptr);
  }
  static std::size_t tidepool_cache_info_of(int device) {
    std::size_t largest = 0;
    EXPECT_EQ(tidepool_cache_info(device, &largest), 0) << tidepool_last_error();
    return largest;
  }
};

TEST_F(TorchCudaAllocatorTest, CacheInfoAnswersWhatTidepoolAnswers) {
  cache_a_block();
  const auto allocator = make_torch_cuda_allocator();
  std::size_t largest = 0;
  allocator->cacheInfo(0, &largest);
  EXPECT_GE(largest, std::size_t{8} << 20);
  EXPECT_EQ(largest, tidepool_cache_info_of(0));
  // A device that does not exist is c10's error, with tidepool's message.
  ::testing::internal::CaptureStderr();
  try {
    allocator->cacheInfo(99, &largest);
    ADD_FAILURE() << "cacheInfo of device 99 did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("device 99 does not exist"), std::string::npos) << e.what();
  }
  ::testing::internal::GetCapturedStderr();
}

TEST_F(TorchCudaAllocatorTest, ResetPeakStatsAndEmptyCacheReachTidepool) {
  cache_a_block();
  const auto allocator = make_torch_cuda_allocator();
  ASSERT_GT(stats().allocated.peak, stats().allocated.current);
  allocator->resetPeakStats(0);
  EXPECT_EQ(stats().allocated.peak, stats().allocated.current);
  ASSERT_GT(stats().cached_bytes, 0u);
  allocator->emptyCache();
  EXPECT_EQ(stats().cached_bytes, 0u) << "c10's emptyCache gives tidepool's cache back";
}

// torch.cuda.memory_stats() reads c10's DeviceStats: tidepool's figures, copied from its
// PyTorch view (Note [PyTorch's view of the stats]), with the accumulated reset.
TEST_F(TorchCudaAllocatorTest, DeviceStatsAreTidepoolsPyTorchView) {
  using c10::CachingAllocator::StatType;
  constexpr auto kAll = static_cast<std::size_t>(StatType::AGGREGATE);
  constexpr auto kLarge = static_cast<std::size_t>(StatType::LARGE_POOL);
  constexpr auto kSmall = static_cast<std::size_t>(StatType::SMALL_POOL);
  const auto allocator = make_torch_cuda_allocator();
  constexpr std::size_t kBlock = std::size_t{6} << 20;
  void* p = tidepool_malloc(kBlock, 0, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  auto d = allocator->getDeviceStats(0);
  tidepool_stats_v1 s = stats();
  EXPECT_EQ(d.allocated_bytes[kAll].current, static_cast<int64_t>(s.allocated.current));
  EXPECT_EQ(d.allocated_bytes[kAll].peak, static_cast<int64_t>(s.allocated.peak));
  EXPECT_EQ(d.allocated_bytes[kLarge].current, d.allocated_bytes[kAll].current);
  EXPECT_EQ(d.allocated_bytes[kSmall].current, 0);
  EXPECT_EQ(d.reserved_bytes[kAll].current, static_cast<int64_t>(s.reserved.current));
  EXPECT_EQ(d.requested_bytes[kAll].current, static_cast<int64_t>(s.requested.current));
  EXPECT_EQ(d.allocation[kAll].current, static_cast<int64_t>(s.allocations.current));
  EXPECT_EQ(d.allocation[kAll].peak, static_cast<int64_t>(s.allocations.peak));
  EXPECT_EQ(d.segment[kAll].current, static_cast<int64_t>(s.segments.current));
  EXPECT_EQ(d.num_device_alloc, static_cast<int64_t>(s.segments_acquired));
  EXPECT_EQ(d.num_ooms, static_cast<int64_t>(s.oom_count));
  EXPECT_EQ(d.max_split_size, -1);
  EXPECT_GT(d.allocated_bytes[kAll].allocated, 0);

  allocator->resetAccumulatedStats(0);
  d = allocator->getDeviceStats(0);
  EXPECT_EQ(d.allocated_bytes[kAll].allocated, 0);
  EXPECT_EQ(d.allocation[kAll].allocated, 0);
  EXPECT_EQ(d.num_device_alloc, 0);
  EXPECT_EQ(d.allocated_bytes[kAll].current, static_cast<int64_t>(s.allocated.current));
  tidepool_free(p, kBlock, 0, nullptr);
  d = allocator->getDeviceStats(0);
  EXPECT_EQ(d.allocated_bytes[kAll].freed, static_cast<int64_t>(kBlock));
  EXPECT_EQ(stats().free_count, s.free_count + 1) << "tidepool's own totals go on";

  ::testing::internal::CaptureStderr();
  EXPECT_THROW(allocator->getDeviceStats(99), c10::Error);
  EXPECT_THROW(allocator->resetAccumulatedStats(99), c10::Error);
  ::testing::internal::GetCapturedStderr();
}

TEST_F(TorchCudaAllocatorTest, TheMemoryFractionReachesTidepool) {
  const auto allocator = make_torch_cuda_allocator();
  allocator->setMemoryFraction(0.25, 0);
  EXPECT_EQ(tidepool_get_memory_fraction(0), 0.25);
  EXPECT_EQ(allocator->getMemoryFraction(0), 0.25);
  ::testing::internal::CaptureStderr();
  EXPECT_THROW(allocator->setMemoryFraction(2.0, 0), c10::Error);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(allocator->getMemoryFraction(0), 0.25) << "a refused fraction changes nothing";
  allocator->setMemoryFraction(1.0, 0);
  EXPECT_EQ(allocator->getMemoryFraction(0), 1.0);
}

// Through the allocator's own malloc (what LibTorch calls for every CUDA tensor; here over
// the host backend, 8 GiB): running out is c10's OutOfMemoryError, as with PyTorch's own
// allocator; a bad request is a plain c10::Error.
TEST_F(TorchCudaAllocatorTest, OutOfMemoryIsC10sOutOfMemoryError) {
  const auto allocator =
      std::dynamic_pointer_cast<torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator>(
          make_torch_cuda_allocator());
  ASSERT_NE(allocator, nullptr);
  void* p = allocator->malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  allocator->raw_delete(p);
  try {
    allocator->malloc(std::size_t{64} << 30, 0, nullptr);
    ADD_FAILURE() << "64 GiB on an 8 GiB device did not throw";
  } catch (const c10::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("tidepool: out of memory"), std::string::npos) << e.what();
  }
  ::testing::internal::CaptureStderr();
  try {
    allocator->malloc(std::size_t{1} << 60, 0, nullptr);
    ADD_FAILURE() << "an absurd size did not throw";
  } catch (const c10::OutOfMemoryError& e) {
    ADD_FAILURE() << "an absurd size is a bad request, not out of memory: " << e.what();
  } catch (const c10::Error& e) {
    EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 0);
  }
  ::testing::internal::GetCapturedStderr();
}

// CUDA graph capture and torch.cuda.MemPool need memory pools, which global mode lacks:
// a clear error that names the way out, not memory reused under a captured graph.
TEST_F(TorchCudaAllocatorTest, MemoryPoolsAreRefusedNamingPoolMode) {
  const auto allocator = make_torch_cuda_allocator();
  const auto refused = [](const auto& call) {
    try {
      call();
      ADD_FAILURE() << "a memory pool was not refused";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("tidepool.mode:pool"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("CUDA graph"), std::string::npos) << e.what();
    }
  };
  refused([&] { allocator->createOrIncrefPool(0, {1, 0}, nullptr); });
  refused([&] { allocator->beginAllocateToPool(0, {1, 0}, [](cudaStream_t) { return true; }); });
}

TEST_F(TorchCudaAllocatorTest, InstalledItIsWhatC10Calls) {
  ASSERT_EQ(tidepool_torch_install_cuda_allocator(), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_torch_install_cuda_allocator(), 0) << "a second call changes nothing";
  cache_a_block();
  std::size_t largest = 0;
  c10::cuda::CUDACachingAllocator::cacheInfo(0, &largest);  // what cuDNN's autotuner calls
  EXPECT_EQ(largest, tidepool_cache_info_of(0));
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  EXPECT_EQ(stats().allocated.peak, stats().allocated.current);
  c10::cuda::CUDACachingAllocator::emptyCache();
  EXPECT_EQ(stats().cached_bytes, 0u);
  const auto d = c10::cuda::CUDACachingAllocator::getDeviceStats(0);  // torch.cuda.memory_stats
  EXPECT_EQ(d.reserved_bytes[0].current, static_cast<int64_t>(stats().reserved.current));
  c10::cuda::CUDACachingAllocator::resetAccumulatedStats(0);
  EXPECT_EQ(c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocation[0].allocated, 0);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(0.5, 0);  // set_per_process_memory_fraction
  EXPECT_EQ(c10::cuda::CUDACachingAllocator::getMemoryFraction(0), 0.5);
  c10::cuda::CUDACachingAllocator::setMemoryFraction(1.0, 0);
}

}  // namespace
}  // namespace tidepool::optim

#else

TEST(TorchCudaAllocatorTest, NeedsACudaBuild) {
  GTEST_SKIP() << "tidepool_torch_cuda is built only with CUDA";
}

#endif
