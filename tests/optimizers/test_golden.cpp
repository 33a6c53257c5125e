// Golden trajectories of the published Apollo and AADL (../shared/golden): every file passes
// at the README's tolerance in fp64 and fp32 runs within 1e-4 (both decided by judge()),
// Apollo through its fused host step and through LibTorch ops; save → load → continue and
// the state placement do not change a single bit.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "golden_expect.h"
#include "golden_runner.h"
#include "allocator/backend.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "store_with_budget.h"
#include "tiering/tiered_store.h"

namespace {

using tidepool::testing::GoldenCase;
using tidepool::testing::RunOptions;
using tidepool::testing::expect_passes;

std::vector<std::string> golden_files() {
  return tidepool::testing::golden_files(TIDEPOOL_SHARED_DIR);
}

std::string test_name(const ::testing::TestParamInfo<std::string>& info) {
  return std::filesystem::path(info.param).stem().string();
}

class Golden : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { golden_ = tidepool::testing::load_golden(GetParam()); }
  GoldenCase golden_;
};

TEST(GoldenFiles, ArePresent) {
  // The parameterised tests below would silently vanish without the files.
  EXPECT_GE(golden_files().size(), 6u) << "no golden files under " << TIDEPOOL_SHARED_DIR;
}

TEST_P(Golden, Float64MatchesReferenceEveryStep) { expect_passes(golden_, RunOptions{}); }

// The fused host step is Apollo's default for CPU parameters; the reference's sequence of
// LibTorch ops must pass too.
TEST_P(Golden, OpsPathMatchesReferenceEveryStep) {
  if (golden_.optimizer["type"].string() != "Apollo") GTEST_SKIP() << "an Apollo choice";
  RunOptions ops;
  ops.fused_kernels = false;
  expect_passes(golden_, ops);
}

TEST_P(Golden, Float32StaysWithin1em4OfReference) {
  RunOptions options;
  options.dtype = torch::kFloat32;
  expect_passes(golden_, options);
}

TEST_P(Golden, SaveLoadContinueIsBitwiseIdentical) {
  const auto straight = tidepool::testing::run_golden(golden_);
  RunOptions reload;
  reload.reload_after = static_cast<int64_t>(golden_.steps.size()) / 2;
  const auto resumed = tidepool::testing::run_golden(golden_, reload);
  EXPECT_TRUE(tidepool::testing::bitwise_equal(straight, resumed));
}

TEST_P(Golden, HostStagedPlacementIsBitwiseIdenticalToResident) {
  RunOptions resident;
  resident.placement = std::make_shared<tidepool::optim::ResidentPlacement>();
  RunOptions staged;
  staged.placement = std::make_shared<tidepool::optim::HostStagedPlacement>();
  const auto a = tidepool::testing::run_golden(golden_, resident);
  const auto b = tidepool::testing::run_golden(golden_, staged);
  EXPECT_TRUE(tidepool::testing::bitwise_equal(a, b));
  // And both are the real thing, not two identical wrong answers.
  EXPECT_TRUE(tidepool::testing::judge(golden_, tidepool::testing::compare(golden_, b),
                                       torch::kFloat64).pass);
}

TEST_P(Golden, TieredPlacementIsBitwiseIdenticalToResident) {
  // The host backend's "device" is host memory LibTorch's CPU ops can use. Apollo: a 2 KiB
  // budget is below its total state (3 × 92 fp64 = 2208 B), so buffers are evicted and
  // brought back during the run. AADL's passes acquire one stored chunk of every history
  // vector at once; these vectors are one chunk each (up to 5 × 736 B), so 4 KiB.
  const bool aadl = golden_.optimizer["type"].string() == "AADL";
  std::unique_ptr<tidepool::Backend> backend = tidepool::make_host_backend();
  const std::size_t budget = aadl ? 4096 : 2048;
  auto store = tidepool::testing::store_with_budget(*backend, budget);
  RunOptions tiered;
  tiered.placement = std::make_shared<tidepool::optim::TieredPlacement>(store);
  RunOptions resident;
  resident.placement = std::make_shared<tidepool::optim::ResidentPlacement>();
  const auto a = tidepool::testing::run_golden(golden_, resident);
  const auto b = tidepool::testing::run_golden(golden_, tiered);
  EXPECT_TRUE(tidepool::testing::bitwise_equal(a, b));
  const auto stats = store->stats();
  if (!aadl) {
    EXPECT_GT(stats.evictions, 0u) << "the budget did not force any eviction";
  }
  EXPECT_GT(stats.acquires, 0u);
  EXPECT_LE(stats.device_peak_bytes, budget);
}

INSTANTIATE_TEST_SUITE_P(Files, Golden, ::testing::ValuesIn(golden_files()), test_name);

TEST(GoldenLoader, MalformedFileThrowsNamingIt) {
  // The process id keeps two build trees' runs (or another user's leftover) apart.
  const auto path = std::filesystem::temp_directory_path() /
                    ("tidepool_bad_golden." + std::to_string(::getpid()) + ".json");
  {
    std::FILE* f = std::fopen(path.string().c_str(), "w");
    ASSERT_NE(f, nullptr);
    std::fputs("{\"name\": \"x\", \"problem\": [1, 2", f);
    std::fclose(f);
  }
  try {
    tidepool::testing::load_golden(path.string());
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
  std::filesystem::remove(path);
}

}  // namespace
