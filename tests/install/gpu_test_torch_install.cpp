// tidepool::optim::install_from_env on a machine with CUDA: tidepool becomes LibTorch's
// CUDA allocator, so a CUDA tensor's memory is counted by tidepool's stats, and a second
// call is harmless. Skips itself without CUDA (label gpu).
#include "optimizers/install/torch_install.h"

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

}  // namespace
}  // namespace tidepool::optim
