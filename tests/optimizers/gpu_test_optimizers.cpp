// GPU checks of the optimizers (ctest label gpu; skipped without a CUDA device): the fused
// Apollo kernels and AADL on CUDA pass the golden files, fp32 stays within 1e-4, the fused
// path is bitwise reproducible, and state / history placement does not change any bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include <torch/cuda.h>

#include "golden_runner.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"

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

TEST_P(GoldenOnGpu, Float64MatchesReference) {
  const auto d = tidepool::testing::compare(golden_, tidepool::testing::run_golden(golden_, cuda()));
  EXPECT_LE(d.max_scaled, tidepool::testing::kGoldenTolerance) << "worst step " << d.worst_step;
}

TEST_P(GoldenOnGpu, OpsPathMatchesReferenceToo) {
  RunOptions o = cuda();
  o.fused_kernels = false;
  const auto d = tidepool::testing::compare(golden_, tidepool::testing::run_golden(golden_, o));
  EXPECT_LE(d.max_scaled, tidepool::testing::kGoldenTolerance);
}

TEST_P(GoldenOnGpu, Float32StaysWithin1em4) {
  const auto d = tidepool::testing::compare(
      golden_, tidepool::testing::run_golden(golden_, cuda(torch::kFloat32)));
  EXPECT_LE(d.max_scaled, 1e-4);
}

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
  for (const char* rebound : {"constant", "belief"}) {
    for (const char* decay : {"L2", "decoupled", "stable"}) {
      torch::manual_seed(1);
      const auto opts = torch::TensorOptions().dtype(torch::kFloat64).device(torch::kCUDA);
      std::vector<torch::Tensor> a = {torch::randn({1000003}, opts), torch::randn({7, 13}, opts)};
      std::vector<torch::Tensor> b;
      for (auto& t : a) {
        t.set_requires_grad(true);
        b.push_back(t.detach().clone().set_requires_grad(true));
      }
      auto options = tidepool::optim::ApolloOptions(0.01).warmup(2).weight_decay(1e-2);
      options.rebound(rebound).weight_decay_type(decay);
      tidepool::optim::Apollo fused(a, options);
      tidepool::optim::Apollo ops(b, options);
      ops.set_fused_kernels(false);
      for (int step = 0; step < 5; ++step) {
        for (size_t i = 0; i < a.size(); ++i) {
          a[i].mutable_grad() = torch::sin(a[i].detach() * (step + 1));
          b[i].mutable_grad() = torch::sin(b[i].detach() * (step + 1));
        }
        fused.step();
        ops.step();
      }
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(torch::allclose(a[i].detach(), b[i].detach(), 1e-10, 1e-12))
            << rebound << "/" << decay << " tensor " << i;
      }
    }
  }
}

}  // namespace
