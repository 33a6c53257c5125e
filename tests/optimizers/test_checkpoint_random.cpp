// Checkpoints of Apollo and AADL over random problems, written to find what save/load
// loses or breaks:
//   - round trips: a run of random groups, shapes, fp32/fp64, options (Apollo: rebound,
//     warmup, weight decay, fused or LibTorch ops; AADL: every option, around SGD with or
//     without momentum, with or without a closure), parameters left without a gradient
//     at random steps, is saved at random steps (also before the first step, and several
//     times in one run) and loaded into a fresh optimizer over copies of the parameters,
//     built with other options and another placement (resident, host-staged, or a tiered
//     store under a random budget), sometimes one that has already stepped elsewhere:
//     every later step is bitwise the uninterrupted run's, and the store keeps to its
//     budget. Saving twice gives the same bytes; an Apollo archive, loaded and saved
//     again, too (it names parameters by index; AADL's inner LibTorch optimizer names
//     them by TensorImpl address, so for AADL the re-saved archive must resume alike).
//   - bad checkpoints: a valid archive truncated, with random bytes flipped, of the other
//     optimizer, from a problem with other parameter counts, shapes, dtypes, groups or
//     history depth, or AADL's with the inner optimizer's part of another problem, is
//     loaded into an optimizer that has stepped. A load that throws must say what is
//     wrong (past LibTorch's archive reader, naming the optimizer) and leave everything
//     as it was: the state equals a twin's that never saw the archive, both continue
//     bitwise alike, and the tiered store holds the same handles. A load that succeeds
//     must leave an optimizer that steps (unless flipped bytes garbled the values).
// Size: TIDEPOOL_TEST_SCALE x 20 problems per round-trip test and 60 per bad-checkpoint
// test (3 and 9 under sanitizers), about 6 s in all; TIDEPOOL_TEST_SEED draws other ones.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "archive_bytes.h"
#include "checkpoint_checks.h"
#include "checkpoint_problems.h"
#include "tests/support/test_scale.h"
#include "tests/support/test_seed.h"

namespace {

using namespace tidepool::testing::checkpoint;  // the problems and runs checkpointed here
using tidepool::testing::archive_bytes;
using tidepool::testing::load_archive_bytes;

int64_t problem_count() {
  return tidepool::test_support::scaled(tidepool::test_support::kSanitizedBuild ? 3 : 20);
}

// Archives compared without printing them (binary, hundreds of KiB).
::testing::AssertionResult same_bytes(const std::string& a, const std::string& b) {
  if (a == b) return ::testing::AssertionSuccess();
  const auto differ = std::mismatch(a.begin(), a.end(), b.begin(), b.end());
  return ::testing::AssertionFailure()
         << "archives of " << a.size() << " and " << b.size() << " B differ from byte "
         << (differ.first - a.begin());
}

Params values(const Params& params) {
  Params out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

// ---- round trips -------------------------------------------------------------------------

// Random save points in [0, steps]: 1 to 3 of them, in order, sometimes before any step.
std::vector<int> random_save_points(Rng& rng, int steps) {
  std::vector<int> points;
  const int64_t count = 1 + rng.pick(3);
  for (int64_t i = 0; i < count; ++i) {
    points.push_back(rng.percent(15) ? 0 : static_cast<int>(rng.pick(steps + 1)));
  }
  std::sort(points.begin(), points.end());
  points.erase(std::unique(points.begin(), points.end()), points.end());
  return points;
}

struct Checkpoint {
  int step = 0;  // steps taken when saved
  std::string bytes;
  Params params;  // their values then
};

// An uninterrupted run: the parameters after every step, and the checkpoints it saved.
struct Reference {
  std::vector<Params> after;
  std::vector<Checkpoint> checkpoints;
};

template <class Run, class Problem>
Reference run_uninterrupted(Run& run, const Problem& problem, const std::vector<int>& saves) {
  Reference reference;
  for (int step = 0; step <= problem.steps; ++step) {
    if (std::find(saves.begin(), saves.end(), step) != saves.end()) {
      Checkpoint checkpoint{step, archive_bytes(run.optimizer()), values(run.params)};
      EXPECT_TRUE(same_bytes(archive_bytes(run.optimizer()), checkpoint.bytes))
          << "saved twice at step " << step;
      reference.checkpoints.push_back(std::move(checkpoint));
    }
    if (step == problem.steps) break;
    run.step(problem, step);
    reference.after.push_back(values(run.params));
  }
  run.home.expect_within_budget();
  return reference;
}

// Continues `run`, loaded from `checkpoint`, to the end of the problem.
template <class Run, class Problem>
void continue_and_compare(Run& run, const Problem& problem, const Checkpoint& checkpoint,
                          const Reference& reference) {
  for (int step = checkpoint.step; step < problem.steps; ++step) {
    run.step(problem, step);
    ASSERT_NO_FATAL_FAILURE(expect_bitwise(run.params, reference.after[size_t(step)],
                                           " differs after step " + std::to_string(step + 1)));
  }
  run.home.expect_within_budget();
}

// `resave_is_identical`: whether an archive loaded and saved again must keep its bytes
// (Apollo's names parameters by index; LibTorch's inner optimizer in AADL's names them by
// TensorImpl address, so there the re-saved archive must only resume alike).
template <class Run, class Problem>
void round_trips(std::uint64_t fixed, bool resave_is_identical) {
  SCOPED_TRACE(tidepool::test_support::seed_note());
  Rng rng(fixed);
  std::uint64_t evictions_after_load = 0;  // a load into a tiered store that had to evict
  for (int64_t n = 0; n < problem_count() && !::testing::Test::HasFailure(); ++n) {
    Problem problem;
    randomize(rng, problem);
    SCOPED_TRACE("problem " + std::to_string(n) + ": " + problem.describe());
    const auto placement = [&] {
      return random_placement(rng, problem.smallest_budget(), problem.state_bytes());
    };
    Run uninterrupted(problem, placement());
    SCOPED_TRACE("saved from " + uninterrupted.home.choice.describe());
    const Reference reference =
        run_uninterrupted(uninterrupted, problem, random_save_points(rng, problem.steps));
    for (const Checkpoint& checkpoint : reference.checkpoints) {
      const bool used = rng.percent(30);
      Run resumed(problem, placement(), copies(checkpoint.params), rng);
      SCOPED_TRACE("saved at step " + std::to_string(checkpoint.step) + ", loaded into " +
                   (used ? "a used " : "a fresh ") + resumed.home.choice.describe());
      if (used) {
        // A load replaces the state a used optimizer has; it does not add to it.
        resumed.step_elsewhere();
        torch::NoGradGuard no_grad;
        for (size_t i = 0; i < resumed.params.size(); ++i) {
          resumed.params[i].copy_(checkpoint.params[i]);
        }
      }
      load_archive_bytes(resumed.optimizer(), checkpoint.bytes);
      const Checkpoint resaved{checkpoint.step, archive_bytes(resumed.optimizer()),
                               checkpoint.params};
      if (resave_is_identical) {
        EXPECT_TRUE(same_bytes(resaved.bytes, checkpoint.bytes)) << "loaded and saved again";
      }
      Run again(problem, placement(), copies(checkpoint.params), rng);
      load_archive_bytes(again.optimizer(), resaved.bytes);
      ASSERT_NO_FATAL_FAILURE(continue_and_compare(resumed, problem, checkpoint, reference));
      SCOPED_TRACE("saved again, loaded into " + again.home.choice.describe());
      ASSERT_NO_FATAL_FAILURE(continue_and_compare(again, problem, resaved, reference));
      if (resumed.home.store) evictions_after_load += resumed.home.store->stats().evictions;
    }
  }
  if (problem_count() >= 10) {
    EXPECT_GT(evictions_after_load, 0u) << "no budget tight enough to evict after a load";
  }
}

TEST(CheckpointRandom, ApolloResumesBitwiseInAnyPlacement) {
  round_trips<ApolloRun, ApolloProblem>(20261301, /*resave_is_identical=*/true);
}

TEST(CheckpointRandom, AADLResumesBitwiseInAnyPlacement) {
  round_trips<AADLRun, AADLProblem>(20261302, /*resave_is_identical=*/false);
}

// ---- bad checkpoints ---------------------------------------------------------------------

// Other options too (one set per group), so that a load that takes them before it
// refuses the archive shows.
void vary_options(ApolloProblem& problem, Rng& rng) {
  problem.options = random_group_options(problem, rng);
}
void vary_options(AADLProblem& problem, Rng& rng) {
  problem.sgd.lr(0.01 * double(1 + rng.pick(9))).momentum(rng.percent(50) ? 0.0 : 0.5);
  problem.sgd.nesterov(false);
}

// The same problem over other shapes, dtype or groups: an archive of it does not fit.
// `kind`: 0 other parameter count (in the last group), 1 shape, 2 dtype, 3 group count;
// -1 any, in any group.
template <class Problem>
Problem mismatched(const Problem& problem, Rng& rng, std::string& how, int64_t kind = -1) {
  Problem other = problem;
  Shapes& shapes = other.shapes;
  auto& group = kind >= 0 ? shapes.back() : shapes[static_cast<size_t>(rng.pick(shapes.size()))];
  auto& shape = group[static_cast<size_t>(rng.pick(group.size()))];
  switch (kind >= 0 ? kind : rng.pick(4)) {
    case 0:
      how = "another parameter count";
      if (group.size() > 1) {
        group.pop_back();
      } else {
        group.push_back({7});
      }
      break;
    case 1:
      // Same element count where possible (AADL's history vectors then still fit).
      how = "another shape";
      if (group.size() > 1 && group.front() != group.back()) {
        std::rotate(group.begin(), group.begin() + 1, group.end());
      } else if (shape.size() == 2 && shape[0] != shape[1]) {
        std::swap(shape[0], shape[1]);
      } else {
        shape = {numel(shape) + 1};
      }
      break;
    case 2:
      how = "another dtype";
      other.dtype = other.dtype == torch::kFloat32 ? torch::kFloat64 : torch::kFloat32;
      break;
    default:
      how = "another group count";
      if (shapes.size() > 1) {
        for (size_t g = 1; g < shapes.size(); ++g) {
          shapes[0].insert(shapes[0].end(), shapes[g].begin(), shapes[g].end());
        }
        shapes.resize(1);
      } else {
        shapes.push_back({{5}});
      }
      break;
  }
  other.steps = 3;
  other.has_grad.assign(3, std::vector<bool>(other.parameters(), true));
  vary_options(other, rng);
  return other;
}

template <class Run, class Problem>
std::string archive_after_steps(const Problem& problem, int steps) {
  Run run(problem, PlacementChoice{});
  for (int s = 0; s < steps; ++s) run.step(problem, s);
  return archive_bytes(run.optimizer());
}

// An archive that does not fit, and how.
struct BadArchive {
  std::string bytes;
  std::string how;
  // Bytes flipped anywhere, tensor data too: a load may succeed with NaN or huge values,
  // and a step then refuse them (AADL's solve refuses NaN) like after a diverged step.
  bool garbled = false;
  // Can never fit: truncated, another optimizer's, a history deeper than this one's, an
  // inner optimizer's of another parameter count. (A mismatched problem's archive may
  // load: an AADL history of another dtype is converted.)
  bool must_refuse = false;
};

// A valid archive of `problem` (its own, after some steps), damaged at random.
template <class Run, class Problem>
BadArchive damaged(const Problem& problem, Rng& rng) {
  BadArchive bad{archive_after_steps<Run>(problem, static_cast<int>(rng.pick(3))), "", false};
  if (rng.percent(40)) {
    bad.bytes.resize(static_cast<size_t>(rng.pick(bad.bytes.size())));
    bad.how = "its own, truncated to " + std::to_string(bad.bytes.size()) + " B";
    bad.must_refuse = true;
    return bad;
  }
  const int64_t flips = 1 + rng.pick(4);
  bad.how = "its own with " + std::to_string(flips) + " bytes flipped at";
  bad.garbled = true;
  for (int64_t i = 0; i < flips; ++i) {
    const size_t at = static_cast<size_t>(rng.pick(bad.bytes.size()));
    bad.bytes[at] = static_cast<char>(bad.bytes[at] ^ (1 + rng.pick(255)));
    bad.how += " " + std::to_string(at);
  }
  return bad;
}

template <class Run, class Problem>
BadArchive mismatched_archive(const Problem& problem, Rng& rng) {
  BadArchive bad;
  const Problem other = mismatched(problem, rng, bad.how);
  bad.bytes = archive_after_steps<Run>(other, 1 + static_cast<int>(rng.pick(3)));
  return bad;
}

// AADL's own part of a valid archive of `problem`, the inner optimizer's of one with
// another parameter count in its last group: it passes AADL's checks and fails in the
// inner optimizer's load, for a LibTorch optimizer after it took the earlier groups'
// state (it loads group by group), which must not stay. (LibTorch's load checks counts,
// not shapes: an inner archive of other shapes would load.)
BadArchive with_inner_of_another(const AADLProblem& problem, Rng& rng) {
  BadArchive bad;
  const AADLProblem other = mismatched(problem, rng, bad.how, /*kind=*/0);
  bad.how = "its own, with the inner optimizer's of " + bad.how;
  bad.must_refuse = true;
  std::istringstream own_bytes(
      archive_after_steps<AADLRun>(problem, 1 + static_cast<int>(rng.pick(3))));
  torch::serialize::InputArchive own;
  own.load_from(own_bytes);
  torch::serialize::OutputArchive forged;
  copy_archive(own, forged, "inner");
  AADLRun other_run(other, PlacementChoice{});
  for (int s = 0; s < 1 + rng.pick(3); ++s) other_run.step(other, s);
  torch::serialize::OutputArchive inner;
  other_run.aadl->inner().save(inner);
  forged.write("inner", inner);
  std::ostringstream out;
  forged.save_to(out);
  bad.bytes = out.str();
  return bad;
}

BadArchive bad_archive(const ApolloProblem& problem, Rng& rng) {
  const int64_t kind = rng.pick(4);
  if (kind <= 1) return damaged<ApolloRun>(problem, rng);
  if (kind == 2) {
    AADLProblem other;
    randomize(rng, other);
    return {archive_after_steps<AADLRun>(other, static_cast<int>(rng.pick(4))), "AADL's",
            false, true};
  }
  return mismatched_archive<ApolloRun>(problem, rng);
}

BadArchive bad_archive(const AADLProblem& problem, Rng& rng) {
  const int64_t kind = rng.pick(7);
  if (kind == 6) return with_inner_of_another(problem, rng);
  if (kind <= 1) return damaged<AADLRun>(problem, rng);
  if (kind == 2) {
    ApolloProblem other;
    randomize(rng, other);
    return {archive_after_steps<ApolloRun>(other, static_cast<int>(rng.pick(4))), "Apollo's",
            false, true};
  }
  if (kind == 3) {
    // More vectors than this optimizer's history holds.
    AADLProblem deeper = problem;
    deeper.options.history_depth(problem.options.history_depth() + 2).store_each_nth(1);
    deeper.steps = static_cast<int>(deeper.options.history_depth());
    deeper.has_grad.assign(size_t(deeper.steps), std::vector<bool>(deeper.parameters(), true));
    return {archive_after_steps<AADLRun>(deeper, deeper.steps), "a deeper history", false, true};
  }
  return mismatched_archive<AADLRun>(problem, rng);
}

// The state two optimizers hold, compared: whatever a failed load could have touched
// (AADL's: checkpoint_checks.h, overloaded here).
using tidepool::testing::checkpoint::expect_same_state;
void expect_same_state(const ApolloRun& a, const ApolloRun& b) {
  // Apollo's archive is the whole state and the options, by parameter index.
  EXPECT_TRUE(same_bytes(archive_bytes(a.optimizer()), archive_bytes(b.optimizer())))
      << "the state changed";
}

std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

template <class Run, class Problem>
void bad_loads(std::uint64_t fixed) {
  SCOPED_TRACE(tidepool::test_support::seed_note());
  Rng rng(fixed);
  int refused = 0, accepted = 0;
  for (int64_t n = 0; n < 3 * problem_count() && !::testing::Test::HasFailure(); ++n) {
    Problem problem;
    randomize(rng, problem);
    SCOPED_TRACE("problem " + std::to_string(n) + ": " + problem.describe());
    const auto placement = [&] {
      return random_placement(rng, problem.smallest_budget(), problem.state_bytes());
    };
    Run target(problem, placement());
    Run twin(problem, placement());
    const int stepped = 1 + static_cast<int>(rng.pick(size_t(problem.steps - 2)));
    for (int s = 0; s < stepped; ++s) {
      target.step(problem, s);
      twin.step(problem, s);
    }
    const BadArchive bad = bad_archive(problem, rng);
    SCOPED_TRACE("after " + std::to_string(stepped) + " steps in " +
                 target.home.choice.describe() + ", loads an archive: " + bad.how);
    const Holdings before = target.home.holdings();
    bool read = false, loaded = false;
    std::string error;
    try {
      std::istringstream in(bad.bytes);
      torch::serialize::InputArchive archive;
      archive.load_from(in);  // LibTorch's reader: its own errors
      read = true;
      target.optimizer().load(archive);
      loaded = true;
    } catch (const std::exception& e) {
      error = message_of(e);
    }
    if (loaded) {
      ++accepted;
      EXPECT_FALSE(bad.must_refuse) << "loaded an archive it must refuse";
      try {
        target.step(problem, stepped);
      } catch (const std::exception& e) {
        if (!bad.garbled) ADD_FAILURE() << "loaded what the next step refuses: " << e.what();
      }
      continue;
    }
    ++refused;
    SCOPED_TRACE("refused: " + error);
    EXPECT_FALSE(error.empty()) << "an error without a message";
    if (read) {
      // Past LibTorch's reader: the optimizer's own check, which names it.
      EXPECT_NE(error.find(Run::kName), std::string::npos) << "does not say who refused";
    }
    EXPECT_EQ(target.home.holdings(), before) << "the failed load left store handles";
    ASSERT_NO_FATAL_FAILURE(expect_same_state(target, twin));
    ASSERT_NO_FATAL_FAILURE(
        expect_steps_alike(target, twin, problem, stepped, " differs from the twin's"));
  }
  if (problem_count() >= 10) {
    EXPECT_GT(refused, 0) << "no bad archive was refused";
  }
  std::printf("%d bad archives refused, %d loaded\n", refused, accepted);
}

TEST(CheckpointRandom, ABadApolloCheckpointIsRefusedAndChangesNothing) {
  bad_loads<ApolloRun, ApolloProblem>(20261303);
}

TEST(CheckpointRandom, ABadAADLCheckpointIsRefusedAndChangesNothing) {
  bad_loads<AADLRun, AADLProblem>(20261304);
}

}  // namespace
