// Apollo's contract beyond the golden trajectories: option checks and defaults, sparse
// gradients, half-precision and complex parameters, parameter groups, zero_grad,
// step(closure), save/load errors, a step whose state cannot be made (refused whole), a
// write-back or a prefetch that fails, groups added with an invalid or zero lr, and empty
// parameters in every placement.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "archive_bytes.h"
#include "expect_error.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "store_with_budget.h"

namespace {

using tidepool::optim::Apollo;
using tidepool::optim::ApolloOptions;
using tidepool::optim::ApolloParamState;
using tidepool::optim::ApolloRebound;
using tidepool::optim::ApolloWeightDecay;

torch::Tensor param(int64_t n, double value = 0.5) {
  return torch::full({n}, value, torch::kFloat64).set_requires_grad(true);
}

using tidepool::testing::archive_bytes;
using tidepool::testing::expect_error_mentions;
using tidepool::testing::load_archive_bytes;

TEST(ApolloOptions, InvalidValuesAreRejectedWithTheirName) {
  const auto make = [](ApolloOptions o) { return [o] { Apollo({param(3)}, o); }; };
  expect_error_mentions(make(ApolloOptions(-1.0)), "learning rate");
  expect_error_mentions(make(ApolloOptions(0.0)), "learning rate");
  expect_error_mentions(make(ApolloOptions(0.1).init_lr(0.2)), "init_lr");
  expect_error_mentions(make(ApolloOptions(0.1).init_lr(-1e-3)), "init_lr");
  expect_error_mentions(make(ApolloOptions(0.1).beta(1.0)), "beta");
  expect_error_mentions(make(ApolloOptions(0.1).beta(-0.1)), "beta");
  expect_error_mentions(make(ApolloOptions(0.1).eps(-1.0)), "eps");
  expect_error_mentions(make(ApolloOptions(0.1).warmup(-1)), "warmup");
  expect_error_mentions(make(ApolloOptions(0.1).weight_decay(-1.0)), "weight_decay");
  expect_error_mentions([] { ApolloOptions(0.1).rebound("bouncy"); }, "bouncy");
  expect_error_mentions([] { ApolloOptions(0.1).weight_decay_type("L3"); }, "L3");
}

// A group inherits base_lr and init_lr from the constructor's lr (as the Python class
// resolves them), so its own lr may lie below init_lr or between it and base_lr: the
// reference checks no group, and neither is refused here. init_lr above both is.
TEST(ApolloOptions, InitLrIsCheckedAgainstTheLargerOfLrAndBaseLr) {
  const auto make = [](ApolloOptions o) { return [o] { Apollo({param(3)}, o); }; };
  EXPECT_NO_THROW(make(ApolloOptions(0.05).base_lr(0.01).init_lr(0.025))());  // between
  EXPECT_NO_THROW(make(ApolloOptions(1e-6).base_lr(0.01).init_lr(1e-5))());    // above lr
  expect_error_mentions(make(ApolloOptions(0.05).base_lr(0.01).init_lr(0.06)), "init_lr");
  expect_error_mentions(make(ApolloOptions(0.05).base_lr(-0.01)), "base_lr");
}

// In training (steps, checkpoints) init_lr may lie above a decayed lr and base_lr: only
// its sign and finiteness are checked.
TEST(ApolloOptions, TrainingTakesAnLrDecayedBelowInitLr) {
  using Check = ApolloOptions::Check;
  EXPECT_NO_THROW(ApolloOptions(1e-4).base_lr(0.01).init_lr(0.02).validate(Check::training));
  expect_error_mentions([] { ApolloOptions(0.1).init_lr(-1.0).validate(Check::training); },
                        "init_lr");
  auto p = param(3);
  Apollo opt({p}, ApolloOptions(0.1).init_lr(0.05).warmup(2));
  p.mutable_grad() = torch::ones_like(p);
  opt.step();
  const std::string saved = archive_bytes(opt);
  Apollo restored({p}, ApolloOptions(0.1));
  load_archive_bytes(restored, saved);  // lr 0.1 >= init_lr: the ordinary case
  opt.param_groups()[0].options().set_lr(0.01);  // a schedule took lr below init_lr
  opt.step();
  const std::string decayed = archive_bytes(opt);
  EXPECT_NO_THROW(load_archive_bytes(restored, decayed));
  EXPECT_DOUBLE_EQ(restored.param_groups()[0].options().get_lr(), 0.01);
}

TEST(ApolloOptions, DefaultsFollowTheReference) {
  Apollo constant({param(3)}, ApolloOptions(0.5));
  const auto& c = static_cast<const ApolloOptions&>(constant.param_groups()[0].options());
  EXPECT_DOUBLE_EQ(*c.init_lr(), 0.5 / 1000);
  EXPECT_EQ(*c.weight_decay_type(), ApolloWeightDecay::L2);
  EXPECT_DOUBLE_EQ(c.beta(), 0.9);
  EXPECT_DOUBLE_EQ(c.eps(), 1e-4);
  EXPECT_EQ(c.warmup(), 500);
  Apollo belief({param(3)}, ApolloOptions(0.5).rebound("belief"));
  const auto& b = static_cast<const ApolloOptions&>(belief.param_groups()[0].options());
  EXPECT_EQ(*b.weight_decay_type(), ApolloWeightDecay::decoupled);
}

TEST(Apollo, SparseGradientIsRejected) {
  auto p = param(4);
  Apollo opt({p}, ApolloOptions(0.1));
  p.mutable_grad() = torch::sparse_coo_tensor(torch::tensor({{1}}, torch::kLong),
                                              torch::tensor({1.0}, torch::kFloat64), {4});
  const torch::Tensor before = p.detach().clone();
  expect_error_mentions([&] { opt.step(); }, "sparse");
  EXPECT_TRUE(torch::equal(before, p.detach()));
}

// Review finding: only COO gradients were refused; a CSR one reached the fused step after
// the parameters before it had stepped, and its error did not say "sparse".
TEST(Apollo, SparseGradientsOfEveryLayoutAreRefusedBeforeAnythingSteps) {
  auto a = param(4);
  auto b = torch::full({2, 3}, 0.5, torch::kFloat64).set_requires_grad(true);
  Apollo opt({a, b}, ApolloOptions(0.1));
  a.mutable_grad() = torch::ones_like(a);
  for (const auto layout : {torch::kSparseCsr, torch::kSparseCsc}) {
    b.mutable_grad() = layout == torch::kSparseCsr ? torch::ones_like(b).to_sparse_csr()
                                                   : torch::ones_like(b).to_sparse_csc();
    expect_error_mentions([&] { opt.step(); }, "sparse gradients");
    EXPECT_TRUE(torch::equal(a.detach(), param(4).detach()));
    EXPECT_TRUE(opt.state().empty());
  }
}

// Review finding: a sparse parameter with a dense gradient (mutable_grad() checks nothing)
// was given state of its layout and refused part-way through the step.
TEST(Apollo, ASparseParameterIsRefusedBeforeAnythingSteps) {
  auto a = param(4);
  auto b = torch::ones({2, 3}, torch::kFloat64).to_sparse().set_requires_grad(true);
  Apollo opt({a, b}, ApolloOptions(0.1));
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones({2, 3}, torch::kFloat64);
  expect_error_mentions([&] { opt.step(); }, "sparse parameters");
  EXPECT_TRUE(torch::equal(a.detach(), param(4).detach()));
  EXPECT_TRUE(opt.state().empty());
}

// Review finding (session 37 list): an inference tensor cannot be updated in place outside
// InferenceMode; it was not refused up front, so the parameters before it stepped first.
TEST(Apollo, AnInferenceTensorParameterIsRefusedBeforeAnythingSteps) {
  auto a = param(4);
  torch::Tensor b;
  {
    c10::InferenceMode guard;
    b = torch::full({3}, 0.5, torch::kFloat64);
  }
  ASSERT_TRUE(b.is_inference());
  Apollo opt({a, b}, ApolloOptions(0.1));
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones({3}, torch::kFloat64);
  expect_error_mentions([&] { opt.step(); }, "inference tensor");
  EXPECT_TRUE(torch::equal(a.detach(), param(4).detach()));
  EXPECT_TRUE(torch::equal(b, torch::full({3}, 0.5, torch::kFloat64)));
  EXPECT_TRUE(opt.state().empty());
}

// Review finding: torch::optim checks duplicates only against state already made, so
// Apollo({a, a}) took two updates of a per step with one state.
TEST(Apollo, AParameterGivenTwiceIsRefused) {
  auto a = param(4), b = param(4);
  expect_error_mentions([&] { Apollo({a, b, a}, ApolloOptions(0.1)); }, "more than once");
  Apollo opt({a}, ApolloOptions(0.1));
  opt.add_param_group(torch::optim::OptimizerParamGroup({b, a}));  // not Apollo's to check
  a.mutable_grad() = torch::ones_like(a);
  expect_error_mentions([&] { opt.step(); }, "more than once");
  EXPECT_TRUE(torch::equal(a.detach(), param(4).detach()));
}

// Review finding: the fused step wrote the parameter through its data pointer without a
// new autograd version, so a graph that saved the old value used the new one silently
// (here: a second backward through retain_graph after the step). Both paths, both
// dtypes, contiguous and not.
TEST(Apollo, AStepGivesTheParameterANewAutogradVersion) {
  for (const bool fused : {true, false}) {
    for (const bool contiguous : {true, false}) {
      auto w = torch::full({3, 2}, 0.5, torch::kFloat32);
      if (!contiguous) w = w.t();
      w.set_requires_grad(true);
      Apollo opt({w}, ApolloOptions(0.1).warmup(0));
      opt.set_fused_kernels(fused);
      const auto loss = (w * w).sum();  // saves w for its own gradient
      loss.backward({}, /*retain_graph=*/true);
      const auto version = w._version();
      opt.step();
      EXPECT_GT(w._version(), version) << "fused " << fused << " contiguous " << contiguous;
      expect_error_mentions([&] { loss.backward(); }, "modified by an inplace operation");
    }
  }
}

TEST(Apollo, ParametersWithoutGradientsAreLeftAlone) {
  auto a = param(4);
  auto b = param(4);
  Apollo opt({a, b}, ApolloOptions(0.1).warmup(0));
  a.mutable_grad() = torch::ones_like(a);
  opt.step();
  EXPECT_FALSE(torch::equal(a.detach(), torch::full({4}, 0.5, torch::kFloat64)));
  EXPECT_TRUE(torch::equal(b.detach(), torch::full({4}, 0.5, torch::kFloat64)));
  EXPECT_EQ(opt.state().size(), 1u);
}

TEST(Apollo, OneParametersStateIsReadByItsNumberAcrossGroups) {
  auto a = param(4);
  auto b = param(2);
  auto c = param(3);
  Apollo opt({torch::optim::OptimizerParamGroup({a}), torch::optim::OptimizerParamGroup({b, c})},
             ApolloOptions(0.1).warmup(0));
  EXPECT_EQ(opt.parameters_with_state(), (std::vector<bool>{false, false, false}));
  c.mutable_grad() = torch::ones_like(c);
  opt.step();
  EXPECT_EQ(opt.parameters_with_state(), (std::vector<bool>{false, false, true}));
  EXPECT_FALSE(opt.saved_state(0).has_value());
  EXPECT_FALSE(opt.saved_state(1).has_value());
  const auto all = opt.saved_state();
  const auto one = opt.saved_state(2);
  ASSERT_TRUE(one.has_value() && all[2].has_value());
  EXPECT_EQ(one->step, 1);
  EXPECT_TRUE(torch::equal(one->exp_avg_grad, all[2]->exp_avg_grad));
  EXPECT_TRUE(torch::equal(one->approx_hessian, all[2]->approx_hessian));
  EXPECT_TRUE(torch::equal(one->update, all[2]->update));
  EXPECT_THROW((void)opt.saved_state(3), std::out_of_range);
}

TEST(Apollo, ClosureIsCalledWithGradAndItsLossReturned) {
  auto p = param(3);
  Apollo opt({p}, ApolloOptions(0.1));
  int calls = 0;
  const torch::Tensor loss = opt.step([&] {
    ++calls;
    EXPECT_TRUE(torch::GradMode::is_enabled());
    opt.zero_grad();
    torch::Tensor l = (p * p).sum();
    l.backward();
    return l;
  });
  EXPECT_EQ(calls, 1);
  EXPECT_NEAR(loss.item<double>(), 0.75, 1e-15);
  opt.zero_grad();
  EXPECT_FALSE(p.grad().defined());
}

TEST(Apollo, GroupsUseTheirOwnOptions) {
  // Two groups in one optimizer step exactly like two optimizers with those options.
  auto a1 = param(5, 0.3), b1 = param(5, -0.2);
  auto a2 = param(5, 0.3), b2 = param(5, -0.2);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{a1});
  groups.emplace_back(std::vector<torch::Tensor>{b1},
                      std::make_unique<ApolloOptions>(ApolloOptions(0.05).rebound("belief")));
  Apollo together(groups, ApolloOptions(0.2).warmup(2));
  Apollo first({a2}, ApolloOptions(0.2).warmup(2));
  Apollo second({b2}, ApolloOptions(0.05).rebound("belief"));
  for (int step = 0; step < 5; ++step) {
    for (auto* p : {&a1, &b1, &a2, &b2}) p->mutable_grad() = p->detach() * 2 + 0.1 * step;
    together.step();
    first.step();
    second.step();
  }
  EXPECT_TRUE(torch::equal(a1.detach(), a2.detach()));
  EXPECT_TRUE(torch::equal(b1.detach(), b2.detach()));
}

TEST(Apollo, Float32OpsPathTracksFloat64) {
  auto p64 = torch::linspace(-1, 1, 64, torch::kFloat64).set_requires_grad(true);
  auto p32 = p64.detach().to(torch::kFloat32).set_requires_grad(true);
  Apollo o64({p64}, ApolloOptions(0.01).warmup(3));
  Apollo o32({p32}, ApolloOptions(0.01).warmup(3));
  // The LibTorch-ops path (on the CPU fp32 and fp64 take the fused step by default).
  o64.set_fused_kernels(false);
  o32.set_fused_kernels(false);
  for (int step = 0; step < 20; ++step) {
    p64.mutable_grad() = torch::sin(3 * p64.detach());
    p32.mutable_grad() = torch::sin(3 * p32.detach());
    o64.step();
    o32.step();
  }
  EXPECT_LE((p32.detach().to(torch::kFloat64) - p64.detach()).abs().max().item<double>(), 1e-5);
}

// bfloat16 and float16 parameters take the ops path in their own dtype (as the reference
// computes): with the fused step asked for, the same bits as without it, state in the
// parameter's dtype, and within that dtype's precision of the float64 run. Complex
// parameters are refused before anything moves.
TEST(Apollo, HalfPrecisionParametersTakeTheOpsPathInTheirDtype) {
  for (const auto dtype : {torch::kBFloat16, torch::kFloat16}) {
    auto p64 = torch::linspace(-1, 1, 64, torch::kFloat64).set_requires_grad(true);
    auto fused = p64.detach().to(dtype).set_requires_grad(true);
    auto ops = p64.detach().to(dtype).set_requires_grad(true);
    Apollo o64({p64}, ApolloOptions(0.01).warmup(3));
    Apollo o_fused({fused}, ApolloOptions(0.01).warmup(3));
    Apollo o_ops({ops}, ApolloOptions(0.01).warmup(3));
    o_ops.set_fused_kernels(false);
    for (int step = 0; step < 10; ++step) {
      p64.mutable_grad() = torch::sin(3 * p64.detach());
      fused.mutable_grad() = torch::sin(3 * fused.detach());
      ops.mutable_grad() = torch::sin(3 * ops.detach());
      o64.step();
      o_fused.step();
      o_ops.step();
    }
    EXPECT_TRUE(torch::equal(fused.detach(), ops.detach())) << dtype;
    const auto& state = static_cast<ApolloParamState&>(*o_fused.state().begin()->second);
    EXPECT_EQ(state.exp_avg_grad->options().dtype(), dtype);
    EXPECT_LE((fused.detach().to(torch::kFloat64) - p64.detach()).abs().max().item<double>(),
              dtype == torch::kBFloat16 ? 3e-2 : 5e-3)
        << dtype;
  }
  auto complex = torch::zeros({4}, torch::kComplexFloat).set_requires_grad(true);
  auto plain = param(4);
  Apollo opt({plain, complex}, ApolloOptions(0.1));
  plain.mutable_grad() = torch::ones_like(plain);
  complex.mutable_grad() = torch::ones_like(complex);
  expect_error_mentions([&] { opt.step(); }, "ComplexFloat");
  EXPECT_TRUE(torch::equal(plain.detach(), param(4).detach()));
}

// Loads `bytes` into an Apollo over one 3-element parameter that has taken a step with
// lr 0.3: the load must fail with an error that mentions `what`, and leave that state and
// those options as they were.
void expect_load_refused_keeping_state(const std::string& bytes, const char* what) {
  auto q = param(3);
  Apollo target({q}, ApolloOptions(0.3));
  q.mutable_grad() = torch::ones_like(q);
  target.step();
  expect_error_mentions([&] { load_archive_bytes(target, bytes); }, what);
  ASSERT_EQ(target.state().size(), 1u);
  EXPECT_EQ(static_cast<ApolloParamState&>(*target.state().begin()->second).step, 1);
  EXPECT_DOUBLE_EQ(target.param_groups()[0].options().get_lr(), 0.3);
}

TEST(Apollo, LoadRejectsAMismatchedOptimizerAndKeepsItsState) {
  auto p = param(3);
  Apollo source({p, param(2)}, ApolloOptions(0.1));
  expect_load_refused_keeping_state(archive_bytes(source), "parameters");
}

TEST(Apollo, LoadRejectsANegativeStepCountAndKeepsItsState) {
  // A corrupted or hand-made checkpoint: a negative step would divide by zero in the bias
  // correction of the next step and write NaN into the parameter.
  auto p = param(3);
  Apollo source({p}, ApolloOptions(0.1));
  p.mutable_grad() = torch::ones_like(p);
  source.step();
  static_cast<ApolloParamState&>(*source.state().begin()->second).step = -1;
  expect_load_refused_keeping_state(archive_bytes(source), "step -1");
}

TEST(Apollo, ALearningRateOfZeroAfterConstructionStepsAndCheckpoints) {
  // A schedule that decays to 0, or a group frozen with set_lr(0): the reference refuses
  // lr = 0 only in its constructor.
  auto frozen = param(3), training = param(3);
  Apollo opt({torch::optim::OptimizerParamGroup({frozen}),
              torch::optim::OptimizerParamGroup({training})},
             ApolloOptions(0.1).warmup(0));
  opt.param_groups()[0].options().set_lr(0.0);
  const torch::Tensor before = frozen.detach().clone();
  for (int step = 0; step < 3; ++step) {
    frozen.mutable_grad() = torch::ones_like(frozen);
    training.mutable_grad() = torch::ones_like(training);
    opt.step();
  }
  EXPECT_TRUE(torch::equal(frozen.detach(), before));
  EXPECT_FALSE(torch::equal(training.detach(), before));
  const std::string bytes = archive_bytes(opt);
  auto f2 = param(3), t2 = param(3);
  Apollo resumed({torch::optim::OptimizerParamGroup({f2}), torch::optim::OptimizerParamGroup({t2})},
                 ApolloOptions(0.1));
  load_archive_bytes(resumed, bytes);
  EXPECT_DOUBLE_EQ(resumed.param_groups()[0].options().get_lr(), 0.0);
  opt.param_groups()[1].options().set_lr(-0.1);  // negative stays an error
  expect_error_mentions([&] { opt.step(); }, "learning rate");
}

// Review finding: a group added with lr 0 keeps init_lr and base_lr unset until it is
// given an lr (resolve_group_options), and one added with an lr has them fixed at its first
// step; save wrote both as concrete values (0 for the frozen group) and load fixed every
// group's defaults, so after a checkpoint the frozen group's warmup ramped from 0 to 0 (it
// did not move), and the other ramped to the lr it had when saved.
TEST(Apollo, DefaultsAGroupHasNotFixedYetSurviveACheckpoint) {
  for (const auto& [added_lr, steps_before] : {std::pair{0.0, 2}, std::pair{0.1, 0}}) {
    SCOPED_TRACE("added with lr " + std::to_string(added_lr));
    const auto make = [added_lr](const torch::Tensor& a, const torch::Tensor& f) {
      auto opt = std::make_unique<Apollo>(
          std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup({a})},
          ApolloOptions(0.1).warmup(10));
      opt->add_param_group(torch::optim::OptimizerParamGroup(
          {f}, std::make_unique<ApolloOptions>(ApolloOptions(added_lr).warmup(10))));
      return opt;
    };
    auto a = param(3), f = param(2);
    auto opt = make(a, f);
    const auto step = [](Apollo& o, const torch::Tensor& x, const torch::Tensor& y) {
      x.mutable_grad() = torch::ones_like(x);
      y.mutable_grad() = torch::ones_like(y);
      o.step();
    };
    for (int i = 0; i < steps_before; ++i) step(*opt, a, f);
    auto a2 = a.detach().clone().requires_grad_(), f2 = f.detach().clone().requires_grad_();
    auto twin = make(a2, f2);
    load_archive_bytes(*twin, archive_bytes(*opt));
    for (Apollo* o : {opt.get(), twin.get()}) o->param_groups()[1].options().set_lr(0.05);
    const torch::Tensor f_before = f.detach().clone();
    step(*opt, a, f);
    step(*twin, a2, f2);
    EXPECT_FALSE(torch::equal(f.detach(), f_before));  // the group moves once given an lr
    EXPECT_TRUE(torch::equal(f.detach(), f2.detach()));
    EXPECT_TRUE(torch::equal(a.detach(), a2.detach()));
    const auto& resumed = static_cast<const ApolloOptions&>(twin->param_groups()[1].options());
    EXPECT_EQ(resumed.base_lr(), std::optional<double>(0.05));
    EXPECT_EQ(resumed.init_lr(), std::optional<double>(0.05 / 1000.0));
  }
}

TEST(Apollo, ARefusedStepChangesNoGroup) {
  // Everything a step refuses is found before the first parameter moves: here the second
  // group's options, changed through param_groups(), and a parameter converted to another
  // dtype than its state's.
  auto a = param(3), b = param(3);
  Apollo opt({torch::optim::OptimizerParamGroup({a}), torch::optim::OptimizerParamGroup({b})},
             ApolloOptions(0.1).warmup(0));
  const auto grads = [&] {
    a.mutable_grad() = torch::ones_like(a);
    b.mutable_grad() = torch::ones_like(b);
  };
  grads();
  opt.step();
  const torch::Tensor a_before = a.detach().clone(), b_before = b.detach().clone();
  static_cast<ApolloOptions&>(opt.param_groups()[1].options()).beta(1.5);
  grads();
  expect_error_mentions([&] { opt.step(); }, "beta");
  EXPECT_TRUE(torch::equal(a.detach(), a_before));
  static_cast<ApolloOptions&>(opt.param_groups()[1].options()).beta(0.9);
  {
    torch::NoGradGuard no_grad;
    b.set_data(b.detach().to(torch::kFloat32));
  }
  b.mutable_grad() = torch::ones_like(b);
  expect_error_mentions([&] { opt.step(); }, "moved, converted or resized");
  EXPECT_TRUE(torch::equal(a.detach(), a_before));
  EXPECT_TRUE(torch::equal(b.detach().to(torch::kFloat64), b_before));
}

// Note [Checked before any parameter steps] (optimizers/apollo.cpp): the fused step reads
// state and gradient by raw pointer for the parameter's element count. A parameter that
// set_data resized keeps its tensor, and so its old, smaller state: the step wrote past
// it. C++'s mutable_grad() checks nothing: a shorter gradient was read past its end, one
// of another dtype refused half-way through the step, after the parameters before it
// had stepped. Each is now refused before any parameter changes.
TEST(Apollo, AResizedParameterOrAMismatchedGradientIsRefusedBeforeAnythingSteps) {
  auto a = param(3), b = param(10);
  Apollo opt({a, b}, ApolloOptions(0.1).warmup(0));
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones_like(b);
  opt.step();
  const torch::Tensor a_before = a.detach().clone();
  const auto expect_refused = [&](const std::string& word) {
    a.mutable_grad() = torch::ones_like(a);
    expect_error_mentions([&] { opt.step(); }, word);
    EXPECT_TRUE(torch::equal(a.detach(), a_before)) << "the first parameter stepped";
  };
  b.mutable_grad() = torch::ones({4}, torch::kFloat64);  // shorter than b
  expect_refused("gradient");
  b.mutable_grad() = torch::ones({10}, torch::kFloat32);
  expect_refused("gradient");
  b.mutable_grad() = torch::ones({2, 5}, torch::kFloat64);  // as many elements, other shape
  expect_refused("gradient");
  {
    torch::NoGradGuard no_grad;
    b.set_data(torch::full({1 << 16}, 0.5, torch::kFloat64));
  }
  b.mutable_grad() = torch::ones_like(b);
  expect_refused("resized");
  EXPECT_TRUE(torch::equal(b.detach(), torch::full({1 << 16}, 0.5, torch::kFloat64)));
}

// Groups added with add_param_group (not virtual in torch::optim::Optimizer): without
// options, the constructor's init_lr and base_lr (as a group given to the constructor, and
// as the reference's setdefault gives them); with options of their own, init_lr and
// base_lr fixed from their own lr at the first step after joining, not following later lr
// changes (the reference would give them the constructor's: apollo.h, base_lr).
TEST(Apollo, GroupsAddedLaterKeepTheirWarmupThroughLrChanges) {
  auto a = param(3), b = param(4), c = param(2);
  auto a2 = param(3), b2 = param(4);
  const auto options = ApolloOptions(0.1).warmup(10);
  Apollo added({a}, options);
  added.add_param_group(torch::optim::OptimizerParamGroup({b}));
  Apollo given({torch::optim::OptimizerParamGroup({a2}), torch::optim::OptimizerParamGroup({b2})},
               options);
  added.add_param_group(
      torch::optim::OptimizerParamGroup({c}, std::make_unique<ApolloOptions>(
                                                 ApolloOptions(0.05).warmup(10))));
  for (int step = 0; step < 4; ++step) {
    for (auto* p : {&a, &b, &c, &a2, &b2}) p->mutable_grad() = torch::cos(p->detach()) + 0.5;
    added.step();
    given.step();
    for (auto* opt : {&added, &given}) {
      for (auto& group : opt->param_groups()) group.options().set_lr(group.options().get_lr() / 2);
    }
  }
  EXPECT_TRUE(torch::equal(a.detach(), a2.detach()));
  EXPECT_TRUE(torch::equal(b.detach(), b2.detach()));
  const auto& own = static_cast<const ApolloOptions&>(added.param_groups()[2].options());
  EXPECT_EQ(own.base_lr(), std::optional<double>(0.05));
  EXPECT_EQ(own.init_lr(), std::optional<double>(0.05 / 1000));
}

// A group added at lr 0 with an init_lr above it is refused at the next step, before
// anything steps, as the constructor refuses it (review finding: its warmup moved the
// "frozen" parameters); removed, the optimizer steps on.
TEST(Apollo, AGroupAddedFrozenWithAWarmupAboveItIsRefusedAsInTheConstructor) {
  auto a = param(3), c = param(2);
  const auto frozen = ApolloOptions(0.0).init_lr(1e-3).warmup(10);
  expect_error_mentions(
      [&] {
        Apollo({torch::optim::OptimizerParamGroup({c}, std::make_unique<ApolloOptions>(frozen))},
               ApolloOptions(0.1));
      },
      "init_lr");
  Apollo opt({a}, ApolloOptions(0.1).warmup(10));
  opt.add_param_group(
      torch::optim::OptimizerParamGroup({c}, std::make_unique<ApolloOptions>(frozen)));
  for (auto* p : {&a, &c}) p->mutable_grad() = torch::ones_like(*p);
  expect_error_mentions([&] { opt.step(); }, "init_lr");
  EXPECT_TRUE(torch::equal(a.detach(), param(3).detach())) << "a stepped before the refusal";
  EXPECT_TRUE(torch::equal(c.detach(), param(2).detach()));
  EXPECT_TRUE(opt.state().empty());
  const auto& added = static_cast<const ApolloOptions&>(opt.param_groups()[1].options());
  EXPECT_FALSE(added.base_lr().has_value()) << "a refused step fixed options";
  opt.param_groups().pop_back();
  opt.step();
  EXPECT_FALSE(torch::equal(a.detach(), param(3).detach()));
}

// A placement that refuses to make state of `refused` elements (as a tiered store of
// another device refuses a parameter's state), resident otherwise.
class RefusingPlacement final : public tidepool::optim::StatePlacement {
 public:
  explicit RefusingPlacement(int64_t refused) : refused_(refused) {}
  std::unique_ptr<tidepool::optim::StateBuffer> create(const torch::Tensor& initial) override {
    TORCH_CHECK(initial.numel() != refused_, "refusing placement: no state of ", refused_,
                " elements");
    return resident_.create(initial);
  }
  std::string name() const override { return "refusing"; }

 private:
  int64_t refused_;
  tidepool::optim::ResidentPlacement resident_;
};

// The state the step needs is made before any parameter steps: a placement that refuses
// the second parameter's state refuses the step with the first unchanged and no state
// left made, and once that parameter has no gradient the optimizer steps as a fresh one.
TEST(Apollo, AStepWhoseStateCannotBeMadeChangesNothing) {
  auto a = param(3), b = param(7), fresh = param(3);
  Apollo opt({a, b}, ApolloOptions(0.1).warmup(0), std::make_shared<RefusingPlacement>(7));
  Apollo reference({fresh}, ApolloOptions(0.1).warmup(0));
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones_like(b);
  expect_error_mentions([&] { opt.step(); }, "no state of 7 elements");
  EXPECT_TRUE(torch::equal(a.detach(), param(3).detach()));
  EXPECT_TRUE(opt.state().empty());
  b.mutable_grad() = torch::Tensor();
  fresh.mutable_grad() = torch::ones_like(fresh);
  opt.step();
  reference.step();
  EXPECT_TRUE(torch::equal(a.detach(), fresh.detach()));
}

// A parameter of shape {0} takes its (empty) step in every placement, as in the reference.
TEST(Apollo, AnEmptyParameterStepsInEveryPlacement) {
  auto backend = tidepool::make_host_backend();
  const std::vector<std::shared_ptr<tidepool::optim::StatePlacement>> placements = {
      std::make_shared<tidepool::optim::ResidentPlacement>(),
      std::make_shared<tidepool::optim::HostStagedPlacement>(),
      std::make_shared<tidepool::optim::TieredPlacement>(
          tidepool::testing::store_with_budget(*backend, 1 << 20))};
  std::vector<torch::Tensor> results;
  for (const auto& placement : placements) {
    auto a = param(4), empty = param(0), b = param(5);
    Apollo opt({a, empty, b}, ApolloOptions(0.1).warmup(0), placement);
    for (int step = 0; step < 3; ++step) {
      for (auto* p : {&a, &empty, &b}) p->mutable_grad() = torch::sin(p->detach()) + 1.0;
      opt.step();
    }
    EXPECT_EQ(opt.state().size(), 3u) << placement->name();
    results.push_back(torch::cat({a.detach(), b.detach()}));
  }
  EXPECT_TRUE(torch::equal(results[0], results[1]));
  EXPECT_TRUE(torch::equal(results[0], results[2]));
}

// The same on the ops path (bf16, or fused kernels off) with the belief rebound, whose
// inf-norm of an empty tensor threw half-way through the step (review finding): the
// other parameters step as they do without the empty one.
TEST(Apollo, AnEmptyParameterStepsOnTheOpsPathWithTheBeliefRebound) {
  for (const auto dtype : {torch::kBFloat16, torch::kFloat32}) {
    const auto make = [&](int64_t n) { return param(n).to(dtype).detach().requires_grad_(); };
    auto a = make(4), empty = make(0), b = make(5);
    auto a_alone = make(4), b_alone = make(5);
    const auto options = ApolloOptions(0.1).warmup(0).rebound(ApolloRebound::belief);
    Apollo opt({a, empty, b}, options);
    Apollo alone({a_alone, b_alone}, options);
    opt.set_fused_kernels(false);
    alone.set_fused_kernels(false);
    for (int step = 0; step < 3; ++step) {
      for (auto* p : {&a, &empty, &b, &a_alone, &b_alone}) {
        p->mutable_grad() = torch::sin(p->detach()) + 1.0;
      }
      ASSERT_NO_THROW(opt.step()) << c10::toString(dtype);
      alone.step();
    }
    EXPECT_TRUE(torch::equal(a.detach(), a_alone.detach())) << c10::toString(dtype);
    EXPECT_TRUE(torch::equal(b.detach(), b_alone.detach())) << c10::toString(dtype);
  }
}

// A placement that hands out a copy of each buffer's contents and takes it back only on a
// dirty release (a clean one drops it, as a tiered buffer evicted clean drops its device
// copy), whose write-back after the release fails for buffers listed in `failing_after`
// (the copy to the host failed, the device copy kept), and whose prefetches fail while
// `prefetch_fails`. Buffers are numbered in creation order: m, B, d of each parameter.
class WriteBackPlacement final : public tidepool::optim::StatePlacement {
 public:
  std::vector<int> failing_after;
  bool prefetch_fails = false;
  int prefetches_failed = 0;
  std::vector<std::string> events;  // "prefetch N" and "acquire N", N the buffer's number
  std::unique_ptr<tidepool::optim::StateBuffer> create(const torch::Tensor& initial) override {
    return std::make_unique<Buffer>(initial, *this, created_++);
  }
  std::string name() const override { return "write-back"; }

 private:
  class Buffer final : public tidepool::optim::StateBuffer {
   public:
    Buffer(const torch::Tensor& initial, WriteBackPlacement& owner, int number)
        : StateBuffer(initial.sizes(), initial.options()), owner_(owner), number_(number),
          stored_(initial.clone()) {}

   private:
    void do_prefetch() override {
      owner_.events.push_back("prefetch " + std::to_string(number_));
      if (owner_.prefetch_fails) {
        owner_.prefetches_failed++;
        TORCH_CHECK(false, "write-back placement: out of memory staging buffer ", number_);
      }
    }
    torch::Tensor do_acquire() override {
      owner_.events.push_back("acquire " + std::to_string(number_));
      return stored_.clone();
    }
    void do_release(torch::Tensor& working, bool dirty) override {
      if (dirty) stored_ = working.clone();
    }
    void do_after_release() override {
      const auto& failing = owner_.failing_after;
      TORCH_CHECK(std::find(failing.begin(), failing.end(), number_) == failing.end(),
                  "write-back placement: copy back of buffer ", number_, " failed");
    }
    torch::Tensor do_read_host() const override { return stored_.clone(); }
    WriteBackPlacement& owner_;
    int number_;
    torch::Tensor stored_;
  };
  int created_ = 0;
};

// Every parameter's saved state and value, for comparing two optimizers' whole state.
torch::Tensor everything(const Apollo& opt, const std::vector<torch::Tensor>& params) {
  std::vector<torch::Tensor> parts;
  for (const auto& saved : opt.saved_state()) {
    parts.insert(parts.end(), {saved->exp_avg_grad, saved->approx_hessian, saved->update,
                               torch::full({1}, static_cast<double>(saved->step))});
  }
  for (const auto& p : params) parts.push_back(p.detach());
  return torch::cat(parts);
}

// The step wrote m, B and d; m's write-back fails after its release. B and d are still
// released dirty: released clean (the leases' unwinding), a placement may drop their new
// contents, and B and d would go back a step while m, θ and the step count went on.
TEST(Apollo, AFailedWriteBackKeepsTheRestOfTheStepsState) {
  auto placement = std::make_shared<WriteBackPlacement>();
  auto a = param(5), b = param(5);
  Apollo opt({a}, ApolloOptions(0.1).warmup(0), placement);
  Apollo reference({b}, ApolloOptions(0.1).warmup(0));
  for (int step = 0; step < 3; ++step) {
    a.mutable_grad() = torch::cos(a.detach() * (step + 1));
    b.mutable_grad() = torch::cos(b.detach() * (step + 1));
    placement->failing_after = step == 1 ? std::vector<int>{0} : std::vector<int>{};
    if (step == 1) {
      expect_error_mentions([&] { opt.step(); }, "copy back of buffer 0 failed");
    } else {
      opt.step();
    }
    reference.step();
    EXPECT_TRUE(torch::equal(everything(opt, {a}), everything(reference, {b}))) << "step " << step;
  }
}

// The fused step carries its sums from one step to the next and rewrites them in place. A
// step that throws after its kernels (the copy back of a parameter whose memory overlaps
// itself) releases m, B and d clean, and the placement keeps their last contents: the sums
// must go too, or the next step reads the refused step's sums (review finding).
TEST(Apollo, AStepThatThrowsAfterItsKernelsLeavesNoCarriedSums) {
  auto placement = std::make_shared<WriteBackPlacement>();
  auto a = torch::linspace(0.1, 0.6, 6, torch::kFloat64).requires_grad_();
  auto b = a.detach().clone().requires_grad_();
  Apollo opt({a}, ApolloOptions(0.1).warmup(0), placement);
  Apollo reference({b}, ApolloOptions(0.1).warmup(0));
  for (int step = 0; step < 3; ++step) {
    a.mutable_grad() = torch::cos(a.detach() * (step + 1));
    b.mutable_grad() = torch::cos(b.detach() * (step + 1));
    if (step == 1) {
      const torch::Tensor kept = a.detach().clone();
      a.set_data(torch::full({1}, 0.25, torch::kFloat64).expand({6}));
      expect_error_mentions([&] { opt.step(); }, "single memory location");
      a.set_data(kept);
      continue;
    }
    opt.step();
    reference.step();
    EXPECT_TRUE(torch::equal(everything(opt, {a}), everything(reference, {b}))) << "step " << step;
  }
}

// A prefetch is a hint: one that fails (staging out of device memory) is said once and
// the step goes on, loading the state when it is used, to the same result.
TEST(Apollo, AFailedPrefetchDoesNotStopTheStep) {
  auto placement = std::make_shared<WriteBackPlacement>();
  placement->prefetch_fails = true;
  auto a = param(5), b = param(3), a2 = param(5), b2 = param(3);
  Apollo opt({a, b}, ApolloOptions(0.1).warmup(0), placement);
  Apollo reference({a2, b2}, ApolloOptions(0.1).warmup(0));
  for (int step = 0; step < 2; ++step) {
    for (auto* p : {&a, &b, &a2, &b2}) p->mutable_grad() = torch::sin(p->detach()) + 0.5;
    opt.step();
    reference.step();
  }
  EXPECT_GT(placement->prefetches_failed, 0);
  EXPECT_TRUE(torch::equal(everything(opt, {a, b}), everything(reference, {a2, b2})));
}

// The parameter about to step is acquired before the next one is prefetched (review
// finding: with the prefetch first, a host-staged placement short of device memory gave
// it to the prefetch and failed the acquire of the step's first parameter), and the
// prefetch reaches into the next group.
TEST(Apollo, TheCurrentParameterIsAcquiredBeforeTheNextIsPrefetched) {
  auto placement = std::make_shared<WriteBackPlacement>();
  auto a = param(5), b = param(3);
  Apollo opt({torch::optim::OptimizerParamGroup({a}), torch::optim::OptimizerParamGroup({b})},
             ApolloOptions(0.1).warmup(0), placement);
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones_like(b);
  opt.step();
  const std::vector<std::string> expected = {"acquire 0",  "acquire 1",  "acquire 2",
                                             "prefetch 3", "prefetch 4", "prefetch 5",
                                             "acquire 3",  "acquire 4",  "acquire 5"};
  EXPECT_EQ(placement->events, expected);
}

// A group added with an invalid lr is refused, and nothing is fixed from that lr: once
// corrected, the group's warmup ramps from the corrected lr (init_lr fixed from -0.1 was
// refused at every later step, as an invalid init_lr never set). A group added frozen
// (lr 0) fixes its warmup from the lr it is later given, not from 0 (a ramp from 0 to 0:
// it would not move for `warmup` steps).
TEST(Apollo, AGroupAddedWithAnInvalidOrZeroLrTakesItsWarmupFromTheLrItIsGiven) {
  auto a = param(3), bad = param(2), frozen = param(4);
  Apollo opt({a}, ApolloOptions(0.1).warmup(10));
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {bad}, std::make_unique<ApolloOptions>(ApolloOptions(-0.1).warmup(10))));
  opt.add_param_group(torch::optim::OptimizerParamGroup(
      {frozen}, std::make_unique<ApolloOptions>(ApolloOptions(0.0).warmup(10))));
  const auto grads = [&] {
    for (auto* p : {&a, &bad, &frozen}) p->mutable_grad() = torch::cos(p->detach()) + 0.5;
  };
  grads();
  expect_error_mentions([&] { opt.step(); }, "invalid learning rate -0.1");
  opt.param_groups()[1].options().set_lr(0.2);
  const torch::Tensor frozen_before = frozen.detach().clone();
  for (int step = 0; step < 2; ++step) {
    grads();
    opt.step();
  }
  EXPECT_TRUE(torch::equal(frozen.detach(), frozen_before)) << "a group at lr 0 moved";
  const auto& corrected = static_cast<const ApolloOptions&>(opt.param_groups()[1].options());
  EXPECT_EQ(corrected.base_lr(), std::optional<double>(0.2));
  EXPECT_EQ(corrected.init_lr(), std::optional<double>(0.2 / 1000));
  opt.param_groups()[2].options().set_lr(0.05);
  grads();
  opt.step();
  const auto& unfrozen = static_cast<const ApolloOptions&>(opt.param_groups()[2].options());
  EXPECT_EQ(unfrozen.base_lr(), std::optional<double>(0.05));
  EXPECT_EQ(unfrozen.init_lr(), std::optional<double>(0.05 / 1000));
  EXPECT_FALSE(torch::equal(frozen.detach(), frozen_before)) << "the unfrozen group did not move";
}

// The reference checks its constructor's lr only: a group given to the constructor at lr 0
// (frozen from the start) is taken, and stays put; one below 0 is refused.
TEST(Apollo, AGroupGivenToTheConstructorAtLrZeroIsTaken) {
  auto a = param(3), frozen = param(2);
  Apollo opt({torch::optim::OptimizerParamGroup({a}),
              torch::optim::OptimizerParamGroup(
                  {frozen}, std::make_unique<ApolloOptions>(ApolloOptions(0.0).warmup(0)))},
             ApolloOptions(0.1).warmup(0));
  for (auto* p : {&a, &frozen}) p->mutable_grad() = torch::ones_like(*p);
  opt.step();
  EXPECT_TRUE(torch::equal(frozen.detach(), param(2).detach()));
  EXPECT_FALSE(torch::equal(a.detach(), param(3).detach()));
  expect_error_mentions(
      [] {
        Apollo({torch::optim::OptimizerParamGroup(
                   {param(2)}, std::make_unique<ApolloOptions>(ApolloOptions(-0.1)))},
               ApolloOptions(0.1));
      },
      "invalid learning rate -0.1");
}

TEST(Apollo, NullPlacementIsRejected) {
  expect_error_mentions([] { Apollo({param(2)}, ApolloOptions(0.1), nullptr); }, "placement");
}

}  // namespace
