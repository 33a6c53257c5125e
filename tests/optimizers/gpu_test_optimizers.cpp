// GPU checks of the optimizers (ctest label gpu; skipped without a CUDA device): the fused
// Apollo kernels and AADL on CUDA pass the golden files, fp32 stays within 1e-4, the fused
// path is bitwise reproducible and its carried sums change no bit, and state / history
// placement does not change any bit — also with the state in the tiered store on the cuda
// backend or host-staged (its own copy streams, Note [Host-staged copy streams] in
// optimizers/state_placement.cpp), stepped on a LibTorch stream that is not the default
// one (the placement must follow the current stream).
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/cuda.h>

#include "allocator/backend.h"
#include "apollo_fused_check.h"
#include "golden_expect.h"
#include "golden_runner.h"
#include "optimizers/aadl.h"
#include "optimizers/anderson_history.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "store_with_budget.h"
#include "tiering/tiered_store.h"

namespace {

using tidepool::testing::RunOptions;

std::vector<std::string> golden_files() {
  return tidepool::testing::golden_files(TIDEPOOL_SHARED_DIR);
}

class GoldenOnGpu : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
    golden_ = tidepool::testing::load_golden(GetParam());
  }
  RunOptions cuda(torch::Dtype dtype = torch::kFloat64) const {
    RunOptions o;
    o.device = torch::Device(torch::kCUDA, 0);
    o.dtype = dtype;
    return o;
  }
  tidepool::testing::GoldenCase golden_;
};

using tidepool::testing::expect_passes;

TEST_P(GoldenOnGpu, Float64MatchesReference) { expect_passes(golden_, cuda()); }

TEST_P(GoldenOnGpu, OpsPathMatchesReferenceToo) {
  RunOptions o = cuda();
  o.fused_kernels = false;
  expect_passes(golden_, o);
}

TEST_P(GoldenOnGpu, Float32StaysWithin1em4) { expect_passes(golden_, cuda(torch::kFloat32)); }

TEST_P(GoldenOnGpu, RunsAreBitwiseReproducible) {
  const auto a = tidepool::testing::run_golden(golden_, cuda(torch::kFloat32));
  const auto b = tidepool::testing::run_golden(golden_, cuda(torch::kFloat32));
  EXPECT_TRUE(tidepool::testing::bitwise_equal(a, b));
}

TEST_P(GoldenOnGpu, HostStagedPlacementIsBitwiseIdenticalToResident) {
  RunOptions resident = cuda(torch::kFloat32);
  resident.placement = std::make_shared<tidepool::optim::ResidentPlacement>();
  RunOptions staged = cuda(torch::kFloat32);
  staged.placement = std::make_shared<tidepool::optim::HostStagedPlacement>();
  EXPECT_TRUE(tidepool::testing::bitwise_equal(tidepool::testing::run_golden(golden_, resident),
                                               tidepool::testing::run_golden(golden_, staged)));
}

TEST_P(GoldenOnGpu, SaveLoadContinueIsBitwiseIdentical) {
  RunOptions reload = cuda();
  reload.reload_after = static_cast<int64_t>(golden_.steps.size()) / 2;
  EXPECT_TRUE(tidepool::testing::bitwise_equal(tidepool::testing::run_golden(golden_, cuda()),
                                               tidepool::testing::run_golden(golden_, reload)));
}

std::string file_stem(const ::testing::TestParamInfo<std::string>& param_info) {
  return std::filesystem::path(param_info.param).stem().string();
}

INSTANTIATE_TEST_SUITE_P(Files, GoldenOnGpu, ::testing::ValuesIn(golden_files()), file_stem);

TEST(ApolloFusedKernels, MatchTheOpsPathOnLargeMixedTensors) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_TRUE(tidepool::optim::Apollo::has_fused_kernels());
  tidepool::testing::expect_fused_matches_ops(torch::kCUDA);
}

TEST(ApolloFusedKernels, CarriedSumsChangeNoBit) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  tidepool::testing::expect_carried_sums_change_no_bit(torch::kCUDA);
}

TEST(ApolloFusedKernels, ANanGradientGivesNanAsTheOpsPath) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  tidepool::testing::expect_a_nan_gradient_as_the_ops_path(torch::kCUDA);
}

// A non-default LibTorch stream for the scope, so that a placement ordering its copies on
// a fixed stream instead of the current one would race the optimizer's kernels.
struct SideStream {
  c10::cuda::CUDAStreamGuard guard{c10::cuda::getStreamFromPool(false, 0)};
};

TEST(TieredOnGpu, ApolloOnASideStreamIsBitwiseIdenticalToResident) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const auto run = [](const std::shared_ptr<tidepool::optim::StatePlacement>& placement) {
    SideStream side;
    torch::manual_seed(2);
    const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA, 0);
    std::vector<torch::Tensor> params;
    for (int i = 0; i < 8; ++i) {
      params.push_back(torch::randn({int64_t{1} << 20}, opts).set_requires_grad(true));
    }
    tidepool::optim::Apollo apollo(params, tidepool::optim::ApolloOptions(0.01).warmup(2),
                                   placement);
    for (int step = 1; step <= 4; ++step) {
      for (auto& p : params) p.mutable_grad() = torch::sin(p.detach() * step);
      apollo.step();
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().cpu());
    return out;
  };
  std::unique_ptr<tidepool::Backend> backend = tidepool::make_cuda_backend(0);
  // Half of the 96 MiB of state.
  auto store = tidepool::testing::store_with_budget(*backend, std::size_t{48} << 20);
  auto placement = std::make_shared<tidepool::optim::TieredPlacement>(store);
  const auto tiered = run(placement);
  const auto resident = run(std::make_shared<tidepool::optim::ResidentPlacement>());
  const auto staged = run(std::make_shared<tidepool::optim::HostStagedPlacement>());
  ASSERT_EQ(tiered.size(), resident.size());
  ASSERT_EQ(staged.size(), resident.size());
  for (size_t i = 0; i < tiered.size(); ++i) {
    EXPECT_TRUE(torch::equal(tiered[i], resident[i])) << "parameter " << i;
    EXPECT_TRUE(torch::equal(staged[i], resident[i])) << "host-staged, parameter " << i;
  }
  const auto stats = store->stats();
  EXPECT_GT(stats.evictions, 0u);
  EXPECT_GT(stats.prefetch_hits, 0u);
  EXPECT_LE(placement->peak_device_bytes(), store->device_budget_bytes());
}

TEST(TieredOnGpu, AadlHistoryStreamedFromTheStoreIsBitwiseIdenticalToHostStaged) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t n = 3 * tidepool::optim::AndersonHistory::kStoreChunk + 1000;
  const auto run = [&](const std::shared_ptr<tidepool::optim::StatePlacement>& placement) {
    SideStream side;
    torch::manual_seed(3);
    auto p =
        torch::randn({n}, torch::TensorOptions().device(torch::kCUDA, 0)).set_requires_grad(true);
    auto sgd = std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{p},
                                                   torch::optim::SGDOptions(0.1));
    tidepool::optim::AADL aadl(sgd, tidepool::optim::AADLOptions().relaxation(0.5).history_depth(5),
                               placement);
    for (int step = 0; step < 7; ++step) {
      p.mutable_grad() = torch::tanh(p.detach()) - 0.1;
      aadl.step();
    }
    return p.detach().cpu();
  };
  std::unique_ptr<tidepool::Backend> backend = tidepool::make_cuda_backend(0);
  // Two 4 MiB chunks per vector and some room: well below the 60 MiB history.
  auto store = tidepool::testing::store_with_budget(*backend, std::size_t{41} << 20);
  auto placement = std::make_shared<tidepool::optim::TieredPlacement>(store);
  const torch::Tensor tiered = run(placement);
  const torch::Tensor staged = run(std::make_shared<tidepool::optim::HostStagedPlacement>());
  const torch::Tensor resident = run(std::make_shared<tidepool::optim::ResidentPlacement>());
  EXPECT_TRUE(torch::equal(tiered, staged));
  EXPECT_TRUE(torch::equal(staged, resident));
  // The history's vectors entered the store on the device (Note [Creating on the device]),
  // the last one over the buffers of a dropped one (Note [Overwriting on the device]).
  EXPECT_GT(placement->counters().created_on_device, 0u);
  EXPECT_EQ(placement->counters().created_through_host, 0u);
  EXPECT_GT(placement->counters().overwritten_on_device, 0u);
  EXPECT_EQ(placement->counters().overwritten_through_host, 0u);
  EXPECT_LE(store->stats().device_peak_bytes, store->device_budget_bytes());
  EXPECT_GT(store->stats().evictions, 0u);
}

}  // namespace
