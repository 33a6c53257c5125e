// Random optimizer problems for test_checkpoint_random.cpp: Apollo and AADL problems
// (parameter groups and shapes, dtype, options, which parameters have a gradient in each
// step), where their state lives (resident, host-staged, a tiered store under a budget),
// and a run of one problem: its parameters and optimizer, whose gradients depend only on
// the step and the parameters, so two runs of a problem compare bitwise.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "allocator/backend.h"
#include "optimizers/aadl.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "random_options.h"
#include "store_with_budget.h"
#include "tests/support/test_seed.h"
#include "tiering/tiered_store.h"

namespace tidepool::testing::checkpoint {

using tidepool::optim::AADL;
using tidepool::optim::AADLOptions;
using tidepool::optim::Apollo;
using tidepool::optim::ApolloOptions;
using tidepool::optim::StatePlacement;
using tidepool::optim::TieredPlacement;
using tidepool::optim::WriteBack;
using Params = std::vector<torch::Tensor>;
using Shapes = std::vector<std::vector<std::vector<int64_t>>>;  // [group][parameter]

struct Rng {
  explicit Rng(std::uint64_t fixed) : engine(tidepool::test_support::seeded(fixed)) {}
  int64_t pick(std::uint64_t n) { return static_cast<int64_t>(engine() % n); }
  bool percent(int p) { return pick(100) < p; }
  std::mt19937_64 engine;
};

// Random shapes: 1-D or 2-D, `numel` elements at most.
inline std::vector<int64_t> random_shape(Rng& rng, int64_t numel) {
  const int64_t n = 1 + rng.pick(static_cast<std::uint64_t>(numel));
  if (rng.percent(60) || n < 4) return {n};
  const int64_t rows = 2 + rng.pick(3);
  return {rows, std::max<int64_t>(1, n / rows)};
}

inline std::string describe_shapes(const Shapes& shapes) {
  std::string s;
  for (const auto& group : shapes) {
    s += "[";
    for (const auto& shape : group) s += c10::str(at::IntArrayRef(shape)) + " ";
    s += "]";
  }
  return s;
}

inline int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// [step][parameter numbered across groups]; at least one parameter has a gradient in each
// step (AADL's loss needs one to backpropagate through).
inline std::vector<std::vector<bool>> random_gradients(Rng& rng, int steps, size_t parameters) {
  std::vector<std::vector<bool>> has_grad;
  for (int s = 0; s < steps; ++s) {
    std::vector<bool> grads;
    for (size_t i = 0; i < parameters; ++i) grads.push_back(!rng.percent(20));
    grads[static_cast<size_t>(rng.pick(parameters))] = true;
    has_grad.push_back(grads);
  }
  return has_grad;
}

inline Params initial_params(const Shapes& shapes, torch::Dtype dtype, std::uint64_t seed) {
  torch::manual_seed(seed);
  Params params;
  for (const auto& group : shapes) {
    for (const auto& shape : group) {
      params.push_back(torch::randn(shape, dtype).set_requires_grad(true));
    }
  }
  return params;
}

inline std::vector<Params> split(const Shapes& shapes, const Params& params) {
  std::vector<Params> groups;
  size_t i = 0;
  for (const auto& group : shapes) {
    groups.emplace_back(params.begin() + static_cast<std::ptrdiff_t>(i),
                        params.begin() + static_cast<std::ptrdiff_t>(i + group.size()));
    i += group.size();
  }
  return groups;
}

// What an Apollo and an AADL problem have alike: the parameters, grouped, and the steps.
struct ProblemParameters {
  Shapes shapes;  // [group][parameter]
  torch::Dtype dtype = torch::kFloat32;
  int steps = 0;
  std::vector<std::vector<bool>> has_grad;  // random_gradients()
  std::uint64_t seed = 0;                   // of the initial parameters

  size_t parameters() const {
    size_t n = 0;
    for (const auto& group : shapes) n += group.size();
    return n;
  }
  std::size_t element() const { return dtype == torch::kFloat32 ? 4 : 8; }
};

// 1..max_groups groups of 1..3 parameters of random shapes, either dtype, min_steps..
// max_steps steps with random gradients, a seed for the initial values.
inline void randomize_parameters(Rng& rng, ProblemParameters& p, int64_t max_groups,
                                 int min_steps, int max_steps) {
  const int64_t groups = 1 + rng.pick(static_cast<std::uint64_t>(max_groups));
  for (int64_t g = 0; g < groups; ++g) {
    auto& group = p.shapes.emplace_back();
    const int64_t count = 1 + rng.pick(3);
    for (int64_t i = 0; i < count; ++i) group.push_back(random_shape(rng, 1500));
  }
  p.dtype = rng.percent(50) ? torch::kFloat32 : torch::kFloat64;
  p.steps = min_steps + static_cast<int>(rng.pick(static_cast<std::uint64_t>(
                            max_steps - min_steps + 1)));
  p.has_grad = random_gradients(rng, p.steps, p.parameters());
  p.seed = static_cast<std::uint64_t>(rng.pick(1000));
}

// ---- where the state lives ---------------------------------------------------------------

enum class Where { resident, host_staged, tiered };

struct PlacementChoice {
  Where where = Where::resident;
  std::size_t budget = 0;
  WriteBack write_back = WriteBack::automatic;
  std::string describe() const {
    if (where == Where::resident) return "resident";
    if (where == Where::host_staged) return "host-staged";
    return std::string("tiered (") + tidepool::optim::to_string(write_back) + ", budget " +
           std::to_string(budget) + " B)";
  }
};

// `smallest`: the least budget the optimizer steps under; budgets go up to above `total`,
// the bytes of all its state, so some keep everything resident and some evict.
inline PlacementChoice random_placement(Rng& rng, std::size_t smallest, std::size_t total) {
  PlacementChoice choice;
  const int64_t kind = rng.pick(4);
  choice.where = kind == 0 ? Where::resident : kind == 1 ? Where::host_staged : Where::tiered;
  const WriteBack modes[] = {WriteBack::automatic, WriteBack::on_release, WriteBack::on_demand};
  choice.write_back = modes[rng.pick(3)];
  choice.budget = smallest + static_cast<std::size_t>(rng.pick(total + total / 3 + 1));
  return choice;
}

// What the tiered store holds for one optimizer: equal before and after a failed load.
struct Holdings {
  std::size_t handles = 0, acquired = 0, live_bytes = 0;
  bool operator==(const Holdings&) const = default;
  friend std::ostream& operator<<(std::ostream& out, const Holdings& h) {
    return out << h.handles << " handles (" << h.acquired << " acquired), " << h.live_bytes
               << " B live";
  }
};

// The state's home. Declared before the optimizer that uses it, so it goes after it: the
// store outlives the buffers, the backend the store.
struct StateHome {
  explicit StateHome(const PlacementChoice& chosen) : choice(chosen) {
    switch (choice.where) {
      case Where::resident:
        placement = std::make_shared<tidepool::optim::ResidentPlacement>();
        break;
      case Where::host_staged:
        placement = std::make_shared<tidepool::optim::HostStagedPlacement>();
        break;
      case Where::tiered:
        backend = tidepool::make_host_backend();
        store = tidepool::testing::store_with_budget(*backend, choice.budget);
        placement = std::make_shared<TieredPlacement>(store, tidepool::Stream{},
                                                      TIDEPOOL_TAG_OPTIMIZER_STATE,
                                                      choice.write_back);
        break;
    }
  }
  Holdings holdings() const {
    if (!store) return {};
    const auto stats = store->stats();
    return {stats.handles, stats.acquired_handles,
            static_cast<const TieredPlacement&>(*placement).live_bytes()};
  }
  void expect_within_budget() const {
    if (store) {
      EXPECT_LE(store->stats().device_peak_bytes, choice.budget);
    }
  }

  PlacementChoice choice;
  std::unique_ptr<tidepool::Backend> backend;
  std::shared_ptr<tidepool::TieredStore> store;
  std::shared_ptr<StatePlacement> placement;
};

// ---- Apollo problems -----------------------------------------------------------------------

struct ApolloProblem : ProblemParameters {
  std::vector<ApolloOptions> options;  // per group
  bool fused = true;

  // Three state tensors per parameter; the budget must hold two parameters' at once.
  std::size_t smallest_budget() const {
    int64_t largest = 0;
    for (const auto& group : shapes) {
      for (const auto& shape : group) largest = std::max(largest, numel(shape));
    }
    return 2 * 3 * static_cast<std::size_t>(largest) * element();
  }
  std::size_t state_bytes() const {
    std::size_t total = 0;
    for (const auto& group : shapes) {
      for (const auto& shape : group) total += 3 * static_cast<std::size_t>(numel(shape));
    }
    return total * element();
  }
  std::string describe() const {
    std::string s = "Apollo " + describe_shapes(shapes) +
                    (dtype == torch::kFloat32 ? " fp32" : " fp64") +
                    (fused ? ", fused" : ", ops") + ", " + std::to_string(steps) + " steps";
    for (const auto& o : options) s += "; " + tidepool::testing::describe(o);
    return s;
  }
};

// Other options for each of the problem's groups.
inline std::vector<ApolloOptions> random_group_options(const ApolloProblem& problem, Rng& rng) {
  std::vector<ApolloOptions> options;
  for (size_t g = 0; g < problem.shapes.size(); ++g) {
    options.push_back(random_apollo_options(rng.engine));
  }
  return options;
}

inline void randomize(Rng& rng, ApolloProblem& p) {
  randomize_parameters(rng, p, /*max_groups=*/3, /*min_steps=*/3, /*max_steps=*/8);
  p.options = random_group_options(p, rng);
  p.fused = rng.percent(75);
}

struct ApolloRun {
  // Over copies of `initial`, with other options (a load must bring the archive's).
  ApolloRun(const ApolloProblem& problem, const PlacementChoice& choice, Params initial,
            Rng& other)
      : ApolloRun(problem, choice, std::move(initial), random_group_options(problem, other)) {}
  ApolloRun(const ApolloProblem& problem, const PlacementChoice& choice)
      : ApolloRun(problem, choice, initial_params(problem.shapes, problem.dtype, problem.seed),
                  problem.options) {}

  static constexpr const char* kName = "Apollo";  // what its errors name
  torch::optim::Optimizer& optimizer() const { return *apollo; }
  // Step `step` of the problem: its gradients depend on the step and the parameters only.
  void step(const ApolloProblem& problem, int step) {
    for (size_t i = 0; i < params.size(); ++i) {
      const torch::Tensor p = params[i].detach();
      params[i].mutable_grad() = problem.has_grad[static_cast<size_t>(step)][i]
                                     ? torch::sin(p * (step + 1)) + 0.1 * p
                                     : torch::Tensor();
    }
    apollo->step();
  }
  // A step on other gradients, so that the state is not the one a load will bring.
  void step_elsewhere() {
    for (auto& p : params) p.mutable_grad() = torch::cos(p.detach() * 7);
    apollo->step();
  }

  StateHome home;
  Params params;
  std::unique_ptr<Apollo> apollo;

 private:
  ApolloRun(const ApolloProblem& problem, const PlacementChoice& choice, Params initial,
            const std::vector<ApolloOptions>& options)
      : home(choice), params(std::move(initial)) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    const auto grouped = split(problem.shapes, params);
    for (size_t g = 0; g < grouped.size(); ++g) {
      groups.emplace_back(grouped[g], std::make_unique<ApolloOptions>(options[g]));
    }
    apollo = std::make_unique<Apollo>(groups, ApolloOptions(0.5), home.placement);
    apollo->set_fused_kernels(problem.fused);
  }
};

// ---- AADL problems -----------------------------------------------------------------------

struct AADLProblem : ProblemParameters {
  AADLOptions options;
  torch::optim::SGDOptions sgd{0.1};
  bool closure = true;

  std::size_t largest_group_bytes() const {
    int64_t largest = 0;
    for (const auto& group : shapes) {
      int64_t n = 0;
      for (const auto& shape : group) n += numel(shape);
      largest = std::max(largest, n);
    }
    return static_cast<std::size_t>(largest) * element();
  }
  // A pass holds one single-chunk vector of each stored iterate of one group.
  std::size_t smallest_budget() const {
    return static_cast<std::size_t>(options.history_depth()) * largest_group_bytes();
  }
  std::size_t state_bytes() const {
    return static_cast<std::size_t>(options.history_depth()) * shapes.size() *
           largest_group_bytes();
  }
  std::string describe() const {
    return "AADL " + describe_shapes(shapes) + (dtype == torch::kFloat32 ? " fp32" : " fp64") +
           ", " + tidepool::testing::describe(options) + ", SGD momentum " +
           std::to_string(sgd.momentum()) +
           (sgd.nesterov() ? " nesterov" : "") + " wd " + std::to_string(sgd.weight_decay()) +
           (closure ? ", closure" : ", no closure") + ", " + std::to_string(steps) + " steps";
  }
};

inline void randomize(Rng& rng, AADLProblem& p) {
  randomize_parameters(rng, p, /*max_groups=*/2, /*min_steps=*/4, /*max_steps=*/13);
  p.options = random_aadl_options(rng.engine);
  p.sgd = torch::optim::SGDOptions(rng.percent(50) ? 0.2 : 0.05);
  if (rng.percent(60)) p.sgd.momentum(0.9).nesterov(rng.percent(30));
  if (rng.percent(30)) p.sgd.weight_decay(1e-3);
  p.closure = rng.percent(70);
}

struct AADLRun {
  // Over copies of `initial`, with another inner learning rate (a load must bring the
  // archive's); AADL's own options are not in its archive: the problem's.
  AADLRun(const AADLProblem& problem, const PlacementChoice& choice, Params initial, Rng& other)
      : AADLRun(problem, choice, std::move(initial), 0.3 + 0.1 * double(other.pick(5))) {}
  AADLRun(const AADLProblem& problem, const PlacementChoice& choice)
      : AADLRun(problem, choice, initial_params(problem.shapes, problem.dtype, problem.seed),
                problem.sgd.lr()) {}
  AADLRun(const AADLProblem& problem, const PlacementChoice& choice, Params initial,
          double inner_lr)
      : home(choice), params(std::move(initial)) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    for (const auto& group : split(problem.shapes, params)) groups.emplace_back(group);
    torch::optim::SGDOptions sgd = problem.sgd;
    sgd.lr(inner_lr);
    for (const auto& p : params) {
      curvature.push_back(torch::linspace(0.2, 2.0, p.numel(), p.dtype()).view(p.sizes()));
    }
    aadl = std::make_unique<AADL>(std::make_shared<torch::optim::SGD>(groups, sgd),
                                  problem.options, home.placement);
  }

  static constexpr const char* kName = "AADL";
  torch::optim::Optimizer& optimizer() const { return *aadl; }
  // The loss of `step`: over the parameters with a gradient in that step only.
  torch::Tensor loss(const AADLProblem& problem, int step) const {
    torch::Tensor total;
    for (size_t i = 0; i < params.size(); ++i) {
      if (!problem.has_grad[static_cast<size_t>(step)][i]) continue;
      const torch::Tensor& p = params[i];
      const torch::Tensor term = (0.5 * curvature[i] * p * p + 0.3 * torch::sin(2.0 * p)).sum();
      total = total.defined() ? total + term : term;
    }
    return total;
  }
  void step(const AADLProblem& problem, int step) {
    if (problem.closure) {
      aadl->step([&] {
        const bool gradient = torch::GradMode::is_enabled();
        if (gradient) aadl->zero_grad();
        torch::Tensor value = loss(problem, step);
        if (gradient) value.backward();
        return value;
      });
    } else {
      aadl->zero_grad();
      loss(problem, step).backward();
      aadl->step();
    }
  }
  void step_elsewhere() {
    aadl->zero_grad();
    torch::Tensor total = torch::zeros({}, params.front().dtype());
    for (const auto& p : params) total = total + torch::cos(3.0 * p).sum();
    total.backward();
    aadl->step();
  }

  StateHome home;
  Params params;
  Params curvature;
  std::unique_ptr<AADL> aadl;
};

}  // namespace tidepool::testing::checkpoint
