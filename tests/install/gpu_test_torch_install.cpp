// tidepool::optim::install_from_env on a machine with CUDA: tidepool becomes LibTorch's
// CUDA allocator, so a CUDA tensor's memory is counted by tidepool's stats, and a second
// call is harmless; Tensor::record_stream (Note [record_stream from PyTorch] in
// allocator/c_api.h) and c10's emptyCache reach tidepool. Skips itself without CUDA (label gpu).
#include "optimizers/install/torch_install.h"

#include <ATen/cuda/Sleep.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <cstdlib>

#include "allocator/c_api.h"

namespace tidepool::optim {
namespace {

std::uint64_t tidepool_allocated_bytes(int device) {
  tidepool_stats_v1 stats{};
  stats.struct_size = sizeof(stats);
  EXPECT_EQ(tidepool_get_stats_v1(device, &stats), 0) << tidepool_last_error();
  return stats.allocated.current;
}

TEST(TorchInstallGpu, GlobalModeMakesTidepoolLibTorchsCudaAllocator) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA";
  setenv("PYTORCH_ALLOC_CONF", "backend:tidepool", 1);
  const InstallStatus s = install_from_env();
  ASSERT_EQ(s.state, InstallState::installed) << s.message;
  const std::uint64_t before = tidepool_allocated_bytes(0);
  {
    torch::Tensor t = torch::ones({1 << 20}, torch::TensorOptions().device(torch::kCUDA, 0));
    EXPECT_GE(tidepool_allocated_bytes(0), before + (std::uint64_t{4} << 20));
    EXPECT_EQ(t.sum().item<float>(), static_cast<float>(1 << 20));
  }
  torch::cuda::synchronize();
  EXPECT_EQ(tidepool_allocated_bytes(0), before);
  EXPECT_EQ(install_from_env().state, InstallState::installed);
}

// c10's emptyCache reaches tidepool: its cached memory goes back to the device.
TEST(TorchInstallGpu, EmptyCacheGivesTidepoolsCachedMemoryBack) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA";
  setenv("PYTORCH_ALLOC_CONF", "backend:tidepool", 1);
  ASSERT_EQ(install_from_env().state, InstallState::installed);
  {
    torch::Tensor t =
        torch::ones({int64_t{64} << 20}, torch::TensorOptions().device(torch::kCUDA, 0));
  }
  torch::cuda::synchronize();
  tidepool_stats_v1 stats{};
  stats.struct_size = sizeof(stats);
  ASSERT_EQ(tidepool_get_stats_v1(0, &stats), 0) << tidepool_last_error();
  const std::uint64_t cached = stats.reserved.current;
  ASSERT_GE(cached, std::uint64_t{256} << 20);
  c10::cuda::CUDACachingAllocator::emptyCache();
  ASSERT_EQ(tidepool_get_stats_v1(0, &stats), 0) << tidepool_last_error();
  EXPECT_LE(stats.reserved.current + (std::uint64_t{256} << 20), cached);
}

// A tensor read on a side stream and freed on its allocating stream: with record_stream
// its memory must not be handed out again until the side stream is past the read, or the
// next tensor's writes race with it.
// Every kernel runs once before the measured part: CUDA loads a kernel at its first launch,
// and loading may synchronize the context (lazy loading, CUDA's default), which here waited
// for the side stream's sleep, so the read was done before the free and handing the memory
// out again was right (H200, 2026-12-04: the same pointer, the sum right). What the test
// shows needs the read still pending when the next tensor is handed out: it says so when not.
// (Without a GPU: RecordStreamThroughC10HoldsTheMemoryUntilTheStreamPassesIt in
// test_torch_cuda_allocator.cpp, with a stream held by a gate instead of a sleep.)
TEST(TorchInstallGpu, RecordStreamHoldsMemoryUntilTheOtherStreamHasReadIt) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA";
  setenv("PYTORCH_ALLOC_CONF", "backend:tidepool", 1);
  ASSERT_EQ(install_from_env().state, InstallState::installed);
  const auto options = torch::TensorOptions().device(torch::kCUDA, 0);
  constexpr int64_t n = int64_t{8} << 20;
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, 0);
  {  // the kernels of the measured part, loaded
    const c10::cuda::CUDAStreamGuard guard(side);
    at::cuda::sleep(1000);
    (void)torch::ones({n}, options).sum();
  }
  (void)torch::full({n}, 2.0f, options);
  torch::cuda::synchronize();

  torch::Tensor x = torch::ones({n}, options);
  const void* freed = x.data_ptr();
  c10::cuda::CUDAEvent written;
  written.record(c10::cuda::getCurrentCUDAStream(0));
  written.block(side);
  torch::Tensor sum;
  {
    const c10::cuda::CUDAStreamGuard guard(side);
    at::cuda::sleep(int64_t{1} << 30);  // about 0.5 s: the read comes well after the next writes
    sum = x.sum();
  }
  x.record_stream(side);
  x = torch::Tensor();
  const torch::Tensor next = torch::full({n}, 2.0f, options);
  const bool read_pending = !side.query();
  EXPECT_TRUE(read_pending) << "the side stream had read x before the next tensor was handed "
                               "out: nothing was shown (a kernel loaded in between?)";
  if (read_pending) {
    EXPECT_NE(next.data_ptr(), freed) << "handed out again while the side stream still reads it";
  }
  torch::cuda::synchronize();
  EXPECT_EQ(sum.item<float>(), static_cast<float>(n));
}

}  // namespace
}  // namespace tidepool::optim
