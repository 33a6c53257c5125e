// AADL::load against archives damaged in one known place, and across parameter dtypes:
//   - a valid archive with one value replaced (a negative counter or count, a value of the
//     wrong type, a history vector that is not floating point, gram or rhs of another
//     dtype or shape) is refused with a message naming the key, and the optimizer, in a
//     tiered store, goes on bitwise like a twin that never saw the archive, holding the
//     same store handles;
//   - an archive saved from fp64 parameters loads into fp32 ones and the reverse: the
//     history is cast to the parameters' dtype and its matrices are those of the cast
//     vectors (what pushing them would give), not the archive's.
// test_checkpoint_random.cpp damages archives at random; these are the cases it would
// only hit by chance, each checked for its message.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "archive_bytes.h"
#include "checkpoint_checks.h"
#include "checkpoint_problems.h"
#include "expect_error.h"
#include "optimizers/anderson_history.h"

namespace {

using namespace tidepool::testing::checkpoint;  // problems, runs, checks and forging
using tidepool::optim::AndersonHistory;
using tidepool::testing::archive_bytes;
using tidepool::testing::expect_error_mentions;
using tidepool::testing::load_archive_bytes;

// The archive's source steps kSourceSteps times, the optimizer that loads it kStepped:
// other counters (a store and an acceleration every other call: they steer the steps),
// other histories (4 vectors against 2), other momentum buffers. So a load that took
// anything from the archive before refusing it shows in the steps after.
constexpr int kSourceSteps = 8;
constexpr int kStepped = 5;

// Two groups (17 and 6 elements), SGD with momentum, with the safeguard's closure.
AADLProblem fixed_problem(torch::Dtype dtype) {
  AADLProblem p;
  p.shapes = {{{3, 4}, {5}}, {{6}}};
  p.dtype = dtype;
  p.steps = 14;
  p.has_grad.assign(static_cast<size_t>(p.steps), std::vector<bool>(p.parameters(), true));
  p.seed = 17;
  p.options = AADLOptions().history_depth(4).store_each_nth(2).frequency(2).wait_iterations(3);
  p.sgd = torch::optim::SGDOptions(0.05).momentum(0.9);
  p.closure = true;
  return p;
}

PlacementChoice tiered(const AADLProblem& problem) {
  PlacementChoice choice;
  choice.where = Where::tiered;
  // Room for the history a load builds beside the current one.
  choice.budget = 4 * problem.state_bytes();
  return choice;
}

struct BadValue {
  std::string path;     // as with_value takes it
  c10::IValue value;    // what replaces the saved one
  std::string message;  // what the refusal must say
};

// `gram` with its [0, 1] entry's lowest mantissa bit flipped (the [1, 0] entry kept).
torch::Tensor off_diagonal_changed(const torch::Tensor& gram) {
  torch::Tensor changed = gram.clone();
  auto bits = changed.view(torch::kLong);
  bits[0][1] = bits[0][1].item<int64_t>() ^ 1;
  return changed;
}

TEST(AADLLoad, AnArchiveWithOneBadValueIsRefusedNamingItAndChangesNothing) {
  const AADLProblem problem = fixed_problem(torch::kFloat64);
  AADLRun source(problem, PlacementChoice{});
  for (int s = 0; s < kSourceSteps; ++s) source.step(problem, s);
  ASSERT_EQ(source.aadl->history(1).size(), 4);  // gram 2 × 2, rhs 2
  const std::string bytes = archive_bytes(*source.aadl);
  const AndersonHistory& saved0 = source.aadl->history(0);
  const AndersonHistory& saved1 = source.aadl->history(1);
  const std::vector<BadValue> cases = {
      {"call_counter", int64_t{-3},
       "AADL::load: call_counter is -3 in the archive; it must be >= 0 and below 2^63 - 1"},
      {"store_counter", int64_t{-1}, "AADL::load: store_counter is -1 in the archive"},
      {"accepted", int64_t{-1}, "AADL::load: accepted is -1 in the archive"},
      {"rejected", std::numeric_limits<int64_t>::min(),
       "AADL::load: rejected is -9223372036854775808 in the archive"},
      // The next step's increment would overflow.
      {"store_counter", std::numeric_limits<int64_t>::max(),
       "AADL::load: store_counter is 9223372036854775807 in the archive"},
      {"call_counter", std::string("eight"), "AADL::load: call_counter is a String"},
      {"store_counter", 0.0, "AADL::load: store_counter is a Double"},
      {"group_count", std::string("2"), "AADL::load: group_count is a String"},
      {"aadl_format", true, "AADL::load: aadl_format is a Bool"},
      {"history_1/count", int64_t{-1}, "AADL::load: history_1/count is -1"},
      {"history_0/count", 4.0, "AADL::load: history_0/count is a Double"},
      {"history_0/param_count", std::string("2"), "AADL::load: history_0/param_count is a"},
      {"history_1/param_shape_0", int64_t{6}, "AADL::load: history_1/param_shape_0 is a Int"},
      {"history_0/vector_2", int64_t{5}, "AADL::load: history_0/vector_2 is a Int"},
      {"history_0/vector_1", saved0.read_host()[1].to(torch::kLong),
       "AADL::load: history_0/vector_1 is a Long tensor"},
      // Group 0's history is rebuilt in the store before group 1's is refused.
      {"history_1/gram", saved1.gram().to(torch::kFloat32),
       "AADL::load: history_1/gram is a [2, 2] Float tensor"},
      {"history_1/gram", torch::zeros({3, 3}, torch::kFloat64),
       "AADL::load: history_1/gram is a [3, 3] Double tensor"},
      {"history_0/rhs", saved0.rhs().to(torch::kFloat32),
       "AADL::load: history_0/rhs is a [2] Float tensor"},
      // Note [What a loaded Gram matrix must be]: one entry changed, one bit flipped.
      {"history_1/gram", off_diagonal_changed(saved1.gram()),
       "AADL::load: history_1/gram in the archive is not symmetric"},
      {"history_0/gram", -saved0.gram(),
       "AADL::load: history_0/gram in the archive has a negative diagonal entry"},
  };
  for (const BadValue& bad : cases) {
    SCOPED_TRACE(bad.path + " replaced: expecting \"" + bad.message + "\"");
    std::string forged;
    ASSERT_NO_FATAL_FAILURE(forged = with_value(bytes, bad.path, bad.value));
    AADLRun target(problem, tiered(problem));
    AADLRun twin(problem, PlacementChoice{});
    for (int s = 0; s < kStepped; ++s) {
      target.step(problem, s);
      twin.step(problem, s);
    }
    const Holdings before = target.home.holdings();
    expect_error_mentions([&] { load_archive_bytes(*target.aadl, forged); }, bad.message);
    EXPECT_EQ(target.home.holdings(), before) << "the refused load left store handles";
    ASSERT_NO_FATAL_FAILURE(expect_same_state(target, twin));
    ASSERT_NO_FATAL_FAILURE(expect_steps_alike(target, twin, problem, kStepped, " differs"));
  }
}

// The forging itself keeps an archive whole (inner optimizer and all): with a value
// replaced by the one saved, it loads, and the run goes on as the source does.
TEST(AADLLoad, AnArchiveForgedWithItsOwnValueResumesAsTheOriginal) {
  const AADLProblem problem = fixed_problem(torch::kFloat64);
  AADLRun source(problem, PlacementChoice{});
  for (int s = 0; s < kSourceSteps; ++s) source.step(problem, s);
  ASSERT_GT(source.aadl->accepted() + source.aadl->rejected(), 0) << "no safeguard decision";
  const std::string forged = with_value(archive_bytes(*source.aadl), "history_1/count",
                                        source.aadl->history(1).size());
  AADLRun resumed(problem, tiered(problem), copies(source.params), /*inner_lr=*/0.3);
  load_archive_bytes(*resumed.aadl, forged);
  ASSERT_NO_FATAL_FAILURE(expect_same_state(resumed, source));
  ASSERT_NO_FATAL_FAILURE(expect_steps_alike(resumed, source, problem, kSourceSteps, " differs"));
}

// A diverged run saves a Gram matrix of NaN and Inf; it loads as saved (Note [What a loaded
// Gram matrix must be]): the step skips the acceleration then, as it did before the save.
TEST(AADLLoad, ADivergedGramMatrixLoadsAsSaved) {
  const AADLProblem problem = fixed_problem(torch::kFloat64);
  AADLRun source(problem, PlacementChoice{});
  for (int s = 0; s < kSourceSteps; ++s) source.step(problem, s);
  torch::Tensor diverged = source.aadl->history(1).gram().clone();
  diverged.fill_(std::numeric_limits<double>::quiet_NaN());
  diverged[1][1] = std::numeric_limits<double>::infinity();
  const std::string forged = with_value(archive_bytes(*source.aadl), "history_1/gram", diverged);
  AADLRun resumed(problem, PlacementChoice{}, copies(source.params), /*inner_lr=*/0.3);
  load_archive_bytes(*resumed.aadl, forged);
  const torch::Tensor loaded = resumed.aadl->history(1).gram();
  EXPECT_TRUE(torch::isnan(loaded[0][1]).item<bool>());
  EXPECT_TRUE(torch::isinf(loaded[1][1]).item<bool>());
}

// (saved with, loaded into): fp64 → fp32 rounds the history, fp32 → fp64 is exact.
class AADLLoadAcrossDtypes
    : public ::testing::TestWithParam<std::tuple<torch::Dtype, torch::Dtype>> {};

TEST_P(AADLLoadAcrossDtypes, CastsTheHistoryAndRecomputesItsMatrices) {
  const auto [saved_dtype, loaded_dtype] = GetParam();
  const AADLProblem saved_problem = fixed_problem(saved_dtype);
  const AADLProblem loaded_problem = fixed_problem(loaded_dtype);
  AADLRun source(saved_problem, PlacementChoice{});
  for (int s = 0; s < kSourceSteps; ++s) source.step(saved_problem, s);
  AADLRun target(loaded_problem, PlacementChoice{});
  for (int s = 0; s < kStepped; ++s) target.step(loaded_problem, s);
  load_archive_bytes(*target.aadl, archive_bytes(*source.aadl));
  for (size_t g = 0; g < 2; ++g) {
    SCOPED_TRACE("group " + std::to_string(g));
    const AndersonHistory& saved = source.aadl->history(g);
    const AndersonHistory& loaded = target.aadl->history(g);
    ASSERT_EQ(loaded.size(), saved.size());
    ASSERT_GE(saved.size(), 3) << "no matrices to compare";
    // What a history holds after pushing the cast vectors: the loaded one's contents.
    AndersonHistory pushed(saved.depth(), std::make_shared<tidepool::optim::ResidentPlacement>());
    const std::vector<torch::Tensor> saved_vectors = saved.read_host();
    const std::vector<torch::Tensor> loaded_vectors = loaded.read_host();
    for (size_t i = 0; i < saved_vectors.size(); ++i) {
      const torch::Tensor cast = saved_vectors[i].to(loaded_dtype);
      pushed.push(cast);
      EXPECT_EQ(loaded_vectors[i].scalar_type(), loaded_dtype) << "vector " << i;
      EXPECT_TRUE(torch::equal(loaded_vectors[i], cast)) << "vector " << i;
    }
    EXPECT_TRUE(torch::equal(loaded.gram(), pushed.gram()));
    EXPECT_TRUE(torch::equal(loaded.rhs(), pushed.rhs()));
    if (saved_dtype == torch::kFloat64 && loaded_dtype == torch::kFloat32) {
      // Else the archive's matrices would pass the check above as well.
      EXPECT_FALSE(torch::equal(saved.gram(), pushed.gram()))
          << "rounding the vectors left their Gram matrix as it was";
    }
  }
  // And it steps on: stores in the parameters' dtype, accelerates from the loaded history.
  for (int s = kSourceSteps; s < loaded_problem.steps; ++s) target.step(loaded_problem, s);
  for (size_t g = 0; g < 2; ++g) {
    EXPECT_EQ(target.aadl->history(g).newest().scalar_type(), loaded_dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(
    SavedAndLoaded, AADLLoadAcrossDtypes,
    ::testing::Values(std::make_tuple(torch::kFloat64, torch::kFloat32),
                      std::make_tuple(torch::kFloat32, torch::kFloat64)),
    [](const ::testing::TestParamInfo<AADLLoadAcrossDtypes::ParamType>& test) {
      return std::string(std::get<0>(test.param) == torch::kFloat64 ? "Fp64IntoFp32"
                                                                    : "Fp32IntoFp64");
    });

}  // namespace
