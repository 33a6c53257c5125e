// The fused Apollo step on the host (apollo_fused_host.cpp), which CI runs in place of the
// CUDA kernels it cannot: it follows the LibTorch-ops path, its carried sums (Note [carried
// sums] in optimizers/apollo_step_math.h) change no bit and are really what a step uses,
// a step that keeps no carry leaves the buffer alone, the ops path and stable decay drop
// a parameter's carry, and the result does not depend on the number of threads.
#include <gtest/gtest.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "apollo_fused_check.h"
#include "archive_bytes.h"
#include "optimizers/apollo.h"
#include "optimizers/apollo_fused_host.h"

namespace {

using tidepool::optim::Apollo;
using tidepool::optim::ApolloOptions;
using tidepool::optim::ApolloParamState;
using tidepool::testing::archive_bytes;
using tidepool::testing::load_archive_bytes;
namespace kernels = tidepool::optim::kernels;

TEST(ApolloFusedHost, MatchesTheOpsPath) {
  tidepool::testing::expect_fused_matches_ops(torch::kCPU);
}

TEST(ApolloFusedHost, CarriedSumsChangeNoBit) {
  tidepool::testing::expect_carried_sums_change_no_bit(torch::kCPU);
}

TEST(ApolloFusedHost, ANanGradientGivesNanAsTheOpsPath) {
  tidepool::testing::expect_a_nan_gradient_as_the_ops_path(torch::kCPU);
}

// One parameter's state and gradient on the host, as apollo_step_host takes them; fp64,
// where a wrong last bit of a sum shows in the result (fp32 rounds most of them away).
struct HostStep {
  explicit HostStep(int64_t n) {
    torch::manual_seed(3);
    for (torch::Tensor* t : {&param, &grad, &exp_avg, &hessian, &update}) {
      *t = torch::randn({n}, torch::kFloat64);
    }
    carry = torch::zeros({kernels::apollo_carry_doubles(n)}, torch::kFloat64);
  }
  HostStep clone() const {
    HostStep copy(0);
    copy.param = param.clone();
    copy.grad = grad.clone();
    copy.exp_avg = exp_avg.clone();
    copy.hessian = hessian.clone();
    copy.update = update.clone();
    copy.carry = carry.clone();
    return copy;
  }
  void run(const kernels::ApolloStepArgs& args, bool carry_valid) {
    kernels::apollo_step_host(param.data_ptr<double>(), grad.data_ptr<double>(),
                              exp_avg.data_ptr<double>(), hessian.data_ptr<double>(),
                              update.data_ptr<double>(), param.numel(), args,
                              kernels::ApolloCarry{carry.data_ptr<double>(), carry_valid});
  }
  bool same_state(const HostStep& other) const {
    return torch::equal(param, other.param) && torch::equal(exp_avg, other.exp_avg) &&
           torch::equal(hessian, other.hessian) && torch::equal(update, other.update);
  }
  torch::Tensor param, grad, exp_avg, hessian, update, carry;
};

kernels::ApolloStepArgs step_args(kernels::ApolloDecayMode decay, bool belief) {
  kernels::ApolloStepArgs args;
  args.alpha = 0.1;
  args.eps = 1e-4;
  args.lr = 0.01;
  args.weight_decay = 1e-2;
  args.belief = belief;
  args.decay = decay;
  return args;
}

TEST(ApolloFusedHost, AValidCarryIsWhatTheStepReads) {
  // If the first pass recomputed the state sums whatever the carry says, a carry that is
  // wrong but marked valid would change nothing.
  HostStep first(300007);
  const auto args = step_args(kernels::ApolloDecayMode::decoupled, /*belief=*/false);
  first.run(args, /*carry_valid=*/false);
  first.grad = torch::randn_like(first.grad);
  HostStep trusted = first.clone();
  HostStep doubted = first.clone();
  doubted.carry.mul_(2.0);
  trusted.run(args, true);
  doubted.run(args, true);
  EXPECT_FALSE(trusted.same_state(doubted));
  // And the carry it wrote is the same either way: it sums what the update wrote.
  HostStep recomputed = first.clone();
  recomputed.run(args, false);
  EXPECT_TRUE(trusted.same_state(recomputed));
  EXPECT_TRUE(torch::equal(trusted.carry, recomputed.carry));
}

TEST(ApolloFusedHost, StableDecayLeavesTheCarryBufferAlone) {
  HostStep stable(5000);
  stable.carry.fill_(-7.0);
  const torch::Tensor before = stable.carry.clone();
  stable.run(step_args(kernels::ApolloDecayMode::stable, /*belief=*/true), /*carry_valid=*/true);
  EXPECT_TRUE(torch::equal(stable.carry, before));
}

TEST(ApolloFusedHost, TheResultDoesNotDependOnTheThreadCount) {
  const int threads = at::get_num_threads();
  const auto args = step_args(kernels::ApolloDecayMode::stable, /*belief=*/true);
  HostStep one(600007);
  HostStep many = one.clone();
  at::set_num_threads(1);
  one.run(args, false);
  at::set_num_threads(4);
  many.run(args, false);
  at::set_num_threads(threads);
  EXPECT_TRUE(one.same_state(many));
}

torch::Tensor carried_sums_of(Apollo& opt) {
  EXPECT_EQ(opt.state().size(), 1u);
  return static_cast<ApolloParamState&>(*opt.state().begin()->second).carried_sums;
}

TEST(ApolloFused, TheOpsPathAndStableDecayDropTheCarry) {
  auto p = torch::randn({1000}, torch::kFloat64).set_requires_grad(true);
  Apollo opt({p}, ApolloOptions(0.01).warmup(0));
  p.mutable_grad() = torch::ones_like(p);
  opt.step();
  ASSERT_TRUE(carried_sums_of(opt).defined());
  EXPECT_EQ(carried_sums_of(opt).numel(), kernels::apollo_carry_doubles(p.numel()));
  opt.set_fused_kernels(false);
  opt.step();  // changes m, B and d without summing them
  EXPECT_FALSE(carried_sums_of(opt).defined());
  opt.set_fused_kernels(true);
  opt.step();
  EXPECT_TRUE(carried_sums_of(opt).defined());
  auto& options = static_cast<ApolloOptions&>(opt.param_groups()[0].options());
  options.weight_decay(1e-2).weight_decay_type("stable");
  opt.step();
  EXPECT_FALSE(carried_sums_of(opt).defined());
}

TEST(ApolloFused, ALoadedOptimizerStartsWithoutACarry) {
  auto p = torch::randn({1000}, torch::kFloat64).set_requires_grad(true);
  Apollo opt({p}, ApolloOptions(0.01).warmup(0));
  p.mutable_grad() = torch::ones_like(p);
  opt.step();
  load_archive_bytes(opt, archive_bytes(opt));
  EXPECT_FALSE(carried_sums_of(opt).defined());
}

}  // namespace
