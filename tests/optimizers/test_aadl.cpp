// AADL and its history beyond the golden trajectories: option checks, the incremental Gram
// matrix against one formed directly, the extrapolation against the reference formula,
// the no-closure rule (history untouched), history placement, save/load (a load replaces
// the inner optimizer's state; a refused one changes nothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "archive_bytes.h"
#include "expect_error.h"
#include "optimizers/aadl.h"
#include "optimizers/anderson_history.h"
#include "optimizers/state_placement.h"

namespace {

using tidepool::optim::AADL;
using tidepool::optim::AADLOptions;
using tidepool::optim::AndersonHistory;

using tidepool::testing::archive_bytes;
using tidepool::testing::expect_error_mentions;
using tidepool::testing::load_archive_bytes;

std::shared_ptr<torch::optim::SGD> sgd(const torch::Tensor& p) {
  return std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{p},
                                             torch::optim::SGDOptions(0.1));
}

TEST(AADLOptions, InvalidValuesAreRejectedWithTheirName) {
  auto p = torch::zeros({3}, torch::kFloat64).set_requires_grad(true);
  const auto make = [&](AADLOptions o) { return [&p, o] { AADL(sgd(p), o); }; };
  expect_error_mentions(make(AADLOptions().relaxation(0.0)), "relaxation");
  expect_error_mentions(make(AADLOptions().wait_iterations(-1)), "wait_iterations");
  expect_error_mentions(make(AADLOptions().history_depth(2)), "history_depth");
  expect_error_mentions(make(AADLOptions().store_each_nth(0)), "store_each_nth");
  expect_error_mentions(make(AADLOptions().frequency(0)), "frequency");
  expect_error_mentions(make(AADLOptions().reg_acc(-1.0)), "reg_acc");
  expect_error_mentions([] { AADLOptions().acceleration_type("rna"); }, "rna");
  expect_error_mentions([] { AADL(nullptr); }, "inner optimizer");
}

// A group whose parameters have no elements at all is refused when wrapped (it failed
// every step, after the inner update, with a message of the history's); one that becomes
// so later (set_data), and a group given to the wrapper's add_param_group (which nothing
// steps), are refused at the step before anything changes.
TEST(AADL, GroupsItCannotStepAreRefusedBeforeAnythingChanges) {
  auto empty = torch::zeros({0}, torch::kFloat64).set_requires_grad(true);
  expect_error_mentions([&] { AADL(sgd(empty)); }, "no elements");

  auto p = torch::ones({3}, torch::kFloat64).set_requires_grad(true);
  AADL opt(sgd(p));
  p.mutable_grad() = torch::ones_like(p);
  auto q = torch::ones({2}, torch::kFloat64).set_requires_grad(true);
  opt.add_param_group(torch::optim::OptimizerParamGroup({q}));
  expect_error_mentions([&] { opt.step(); }, "add groups to inner()");
  EXPECT_TRUE(torch::equal(p.detach(), torch::ones({3}, torch::kFloat64)));

  auto r = torch::ones({3}, torch::kFloat64).set_requires_grad(true);
  AADL resized(std::make_shared<torch::optim::SGD>(  // momentum: a step leaves state
      std::vector<torch::Tensor>{r}, torch::optim::SGDOptions(0.1).momentum(0.9)));
  {
    torch::NoGradGuard no_grad;
    r.set_data(torch::zeros({0}, torch::kFloat64));
  }
  r.mutable_grad() = torch::zeros_like(r);
  expect_error_mentions([&] { resized.step(); }, "no elements");
  EXPECT_EQ(resized.inner().state().size(), 0u) << "the inner optimizer stepped";
}

// Review finding: a complex parameter lost its imaginary part on every accelerated step
// (the extrapolation is real), and its checkpoint could not be loaded back.
TEST(AADL, ComplexParametersAreRefusedWhenWrapped) {
  auto z = torch::ones({3}, torch::kComplexDouble).set_requires_grad(true);
  expect_error_mentions([&] { AADL(sgd(z)); }, "real floating point");
}

// Review finding: a sparse parameter passed the group check and every step failed after
// the inner update, in the flattening into the history.
TEST(AADL, SparseParametersAreRefusedWhenWrapped) {
  auto sparse = torch::eye(3, torch::kFloat64).to_sparse().set_requires_grad(true);
  expect_error_mentions([&] { AADL(sgd(sparse)); }, "dense");
}

// Review finding: save and load indexed the inner optimizer's groups by the histories'
// count, past the end once a group was taken out of the inner optimizer (its
// param_groups() is mutable).
TEST(AADL, SaveAndLoadRefuseAnInnerOptimizerThatLostAGroup) {
  auto p = torch::ones({3}, torch::kFloat64).set_requires_grad(true);
  auto q = torch::ones({2}, torch::kFloat64).set_requires_grad(true);
  auto inner = std::make_shared<torch::optim::SGD>(
      std::vector<torch::optim::OptimizerParamGroup>{torch::optim::OptimizerParamGroup({p}),
                                                     torch::optim::OptimizerParamGroup({q})},
      torch::optim::SGDOptions(0.1));
  AADL opt(inner);
  const std::string bytes = archive_bytes(opt);
  inner->param_groups().pop_back();
  expect_error_mentions([&] { (void)archive_bytes(opt); }, "it had 2 when wrapped");
  expect_error_mentions([&] { load_archive_bytes(opt, bytes); }, "it had 2 when wrapped");
}

// Review finding: parameters moved to another dtype (or device), or resized, after their
// history was stored passed the group check, and every step then failed after the inner
// update, in the history's push. Refused before anything changes, naming both sides.
TEST(AADL, ParametersChangedAfterTheirHistoryWasStoredAreRefusedBeforeTheInnerStep) {
  auto p = torch::ones({4}, torch::kFloat64).set_requires_grad(true);
  AADL opt(std::make_shared<torch::optim::SGD>(  // momentum: a step leaves state
      std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1).momentum(0.9)));
  const auto loss = [&] {
    opt.zero_grad();
    torch::Tensor l = (p * p).sum();
    l.backward();
    return l;
  };
  for (int i = 0; i < 2; ++i) opt.step(loss);
  {
    torch::NoGradGuard no_grad;
    p.set_data(p.detach().to(torch::kFloat32));
  }
  const torch::Tensor before = p.detach().clone();
  expect_error_mentions([&] { opt.step(loss); }, "4 elements of Double");
  expect_error_mentions([&] { opt.step(loss); }, "need a new AADL");
  EXPECT_TRUE(torch::equal(p.detach(), before)) << "the inner optimizer stepped";
  {
    torch::NoGradGuard no_grad;
    p.set_data(torch::ones({5}, torch::kFloat64));
  }
  expect_error_mentions([&] { opt.step(loss); }, "now 5 elements of Double");
  EXPECT_TRUE(torch::equal(p.detach(), torch::ones({5}, torch::kFloat64)));
}

// DR and b formed directly from the stacked history, as the reference does.
void direct_matrices(const std::vector<torch::Tensor>& xs, torch::Tensor& G, torch::Tensor& c) {
  const torch::Tensor X = torch::stack(xs, 1);
  const torch::Tensor DX = X.slice(1, 1) - X.slice(1, 0, -1);
  const torch::Tensor DR = DX.slice(1, 1) - DX.slice(1, 0, -1);
  G = DR.t().matmul(DR);
  c = DR.t().matmul(DX.select(1, DX.size(1) - 1));
}

TEST(AndersonHistory, IncrementalGramMatchesDirectThroughEvictionAndReplacement) {
  torch::manual_seed(3);
  AndersonHistory history(4, std::make_shared<tidepool::optim::ResidentPlacement>());
  std::vector<torch::Tensor> kept;
  const auto check = [&] {
    torch::Tensor G, c;
    direct_matrices(kept, G, c);
    ASSERT_EQ(history.gram().sizes(), G.sizes());
    EXPECT_TRUE(torch::allclose(history.gram(), G, 1e-12, 1e-12));
    EXPECT_TRUE(torch::allclose(history.rhs(), c, 1e-12, 1e-12));
  };
  // A length that is not a multiple of the streaming chunk exercises the tail.
  const int64_t n = (int64_t{1} << 18) + 17;
  for (int i = 0; i < 7; ++i) {
    torch::Tensor x = torch::randn({n}, torch::kFloat64) * (1.0 / (i + 1));
    history.push(x);
    kept.push_back(x);
    if (kept.size() > 4) kept.erase(kept.begin());
    if (kept.size() >= 3) check();
  }
  torch::Tensor replacement = torch::randn({n}, torch::kFloat64);
  history.replace_newest(replacement);
  kept.back() = replacement;
  check();
  expect_error_mentions([&] { history.push(torch::zeros({5}, torch::kFloat64)); },
                        "does not match the stored ones");
}

// What a pass brings to the compute device: the Gram column pass after a push reads the
// m − 1 older vectors from the placement and the new one from the caller's tensor (it is
// already there); the extrapolation reads all m, or m − 1 when given the newest vector,
// also when it writes its result over that vector. Over two chunks per vector and a tail.
TEST(AndersonHistory, APushDoesNotLoadBackTheVectorItJustStored) {
  constexpr int64_t kDepth = 4;
  const int64_t n = 2 * AndersonHistory::kStoreChunk + 5;
  auto placement = std::make_shared<tidepool::optim::HostStagedPlacement>();
  AndersonHistory history(kDepth, placement);
  AndersonHistory resident(kDepth, std::make_shared<tidepool::optim::ResidentPlacement>());
  torch::manual_seed(4);
  const auto loaded = [&] { return placement->traffic().to_device.load(); };
  const int64_t vector_bytes = n * static_cast<int64_t>(sizeof(float));
  torch::Tensor newest;
  for (int i = 0; i < kDepth + 2; ++i) {
    const torch::Tensor x = torch::randn({n}) * (1.0f / static_cast<float>(i + 1));
    const int64_t before = loaded();
    history.push(x);
    resident.push(x);
    newest = x;
    const int64_t older = std::min<int64_t>(history.size(), kDepth) - 1;
    EXPECT_EQ(loaded() - before, history.size() >= 3 ? older * vector_bytes : 0) << "push " << i;
  }
  EXPECT_TRUE(torch::equal(history.gram(), resident.gram()));
  EXPECT_TRUE(torch::equal(history.rhs(), resident.rhs()));
  const torch::Tensor u = torch::linspace(-0.5, 0.5, kDepth - 1, torch::kFloat64);
  const torch::Tensor expected = resident.combine(u);
  int64_t before = loaded();
  EXPECT_TRUE(torch::equal(history.combine(u), expected));
  EXPECT_EQ(loaded() - before, kDepth * vector_bytes);
  before = loaded();
  EXPECT_TRUE(torch::equal(history.combine(u, newest), expected));
  EXPECT_EQ(loaded() - before, (kDepth - 1) * vector_bytes);
  torch::Tensor overwritten = newest.clone();
  before = loaded();
  const torch::Tensor in_place = history.combine(u, overwritten, overwritten);
  EXPECT_EQ(in_place.data_ptr(), overwritten.data_ptr());
  EXPECT_TRUE(torch::equal(overwritten, expected));
  EXPECT_EQ(loaded() - before, (kDepth - 1) * vector_bytes);
  expect_error_mentions([&] { history.combine(u, newest.narrow(0, 0, n - 1)); }, "1-D tensors");
  expect_error_mentions([&] { history.combine(u, {}, newest.to(torch::kFloat64)); },
                        "1-D tensors");
}

// One accelerated step of AADL over a full history in host memory brings 2(m − 1) vectors
// to the device: the Gram pass and the extrapolation each read the m − 1 older ones, never
// the vector the step stored. With a safeguard that keeps the candidate, the pass after
// replace_newest reads the m − 1 older ones once more.
TEST(AADL, AnAcceleratedStepLoadsOnlyTheOlderVectors) {
  constexpr int64_t kDepth = 4;
  const int64_t n = 2 * AndersonHistory::kStoreChunk + 5;
  const int64_t vector_bytes = n * static_cast<int64_t>(sizeof(float));
  for (const bool with_closure : {false, true}) {
    SCOPED_TRACE(with_closure ? "with a closure" : "without a closure");
    torch::manual_seed(6);
    auto p = torch::randn({n}).set_requires_grad(true);
    auto placement = std::make_shared<tidepool::optim::HostStagedPlacement>();
    AADL opt(sgd(p), AADLOptions().history_depth(kDepth).wait_iterations(kDepth), placement);
    const auto gradient = [&] { p.mutable_grad() = torch::sin(p.detach()); };
    for (int step = 0; step < kDepth; ++step) {
      gradient();
      opt.step();
    }
    ASSERT_EQ(opt.history(0).size(), kDepth);
    const int64_t before = placement->traffic().to_device.load();
    if (with_closure) {
      // Lower at every point but the plain iterate: the candidate is kept.
      const torch::Tensor plain_point = p.detach() - 0.1f * torch::sin(p.detach());
      opt.step([&] {
        if (torch::GradMode::is_enabled()) {
          gradient();
          return torch::zeros({});
        }
        return -(p.detach() - plain_point).abs().sum();
      });
      EXPECT_EQ(opt.accepted(), 1);
    } else {
      gradient();
      opt.step();
    }
    const int64_t older = kDepth - 1;
    EXPECT_EQ(placement->traffic().to_device.load() - before,
              (with_closure ? 3 : 2) * older * vector_bytes);
  }
}

TEST(AADL, ExtrapolationMatchesTheReferenceFormula) {
  // Without a closure the accelerated point is loaded as is: compare it with
  // x = β·x_AA + (1−β)·X[:,:-1]α computed from a dense least-squares solve.
  torch::manual_seed(5);
  auto p = torch::randn({50}, torch::kFloat64).set_requires_grad(true);
  const torch::Tensor A = torch::diag(torch::linspace(0.5, 1.5, 50, torch::kFloat64));
  const double beta = 0.7;
  AADL opt(sgd(p), AADLOptions().relaxation(beta).history_depth(5).wait_iterations(4));
  std::vector<torch::Tensor> xs;
  // SGD's plain iterates (lr 0.1), computed here: the formula's inputs are checked, not
  // taken from the history under test.
  torch::Tensor plain = p.detach().clone();
  for (int step = 0; step < 5; ++step) {
    p.mutable_grad() = A.matmul(p.detach()) - 1.0;
    opt.step();
    plain = plain - 0.1 * (A.matmul(plain) - 1.0);
    ASSERT_TRUE(torch::allclose(opt.history(0).newest(), plain, 1e-13, 1e-14))
        << "step " << step << ": the newest history vector is not the plain iterate";
    xs.push_back(opt.history(0).newest());
  }
  // Step 5 was the first accelerated one: p holds the extrapolation of xs.
  const torch::Tensor X = torch::stack(xs, 1);
  const torch::Tensor DX = X.slice(1, 1) - X.slice(1, 0, -1);
  const torch::Tensor DR = DX.slice(1, 1) - DX.slice(1, 0, -1);
  const torch::Tensor b = DX.select(1, DX.size(1) - 1);
  const torch::Tensor gamma =
      std::get<0>(torch::linalg_lstsq(DR, b.unsqueeze(1), c10::nullopt, std::string("gelsd")))
          .squeeze(1);
  const torch::Tensor x_aa = X.select(1, 3) + b - (DX.slice(1, 0, -1) + DR).matmul(gamma);
  torch::Tensor alpha = torch::zeros({4}, torch::kFloat64);
  alpha[0] = gamma[0];
  alpha.slice(0, 1, 3).copy_(gamma.slice(0, 1) - gamma.slice(0, 0, -1));
  alpha[3] = 1 - gamma[2];
  const torch::Tensor expected = beta * x_aa + (1 - beta) * X.slice(1, 0, -1).matmul(alpha);
  EXPECT_TRUE(torch::allclose(p.detach(), expected, 1e-9, 1e-12));
  // The history keeps the plain iterate when there is no closure.
  EXPECT_TRUE(torch::equal(opt.history(0).newest(), xs.back()));
  EXPECT_FALSE(torch::allclose(p.detach(), xs.back()));
}

// AADL over SGD on p beside a plain SGD on a copy q, stepped with closures whose loss is
// zero at the newest stored iterate (the plain one) and positive anywhere else: the
// safeguard rejects every candidate, so p stays on q's path.
struct AADLBesidePlainSGD {
  torch::Tensor p = torch::full({4}, 1.0, torch::kFloat64).set_requires_grad(true);
  torch::Tensor q = p.detach().clone().set_requires_grad(true);
  AADL opt{sgd(p), AADLOptions().relaxation(1.0).history_depth(4)};
  std::shared_ptr<torch::optim::SGD> plain = sgd(q);
  // The closure's call without gradients (a safeguard evaluation) that throws an out of
  // memory error, counted from 1 in each step; 0: none.
  int throwing_evaluation = 0;

  // Steps the plain SGD with step `step`'s gradient and returns AADL's closure for it.
  AADL::LossClosure closure_for(int step) {
    const torch::Tensor g = torch::cos(p.detach() * (step + 1));
    q.mutable_grad() = g.clone();
    plain->step();
    auto evaluations = std::make_shared<int>(0);
    return [this, g, evaluations] {
      if (torch::GradMode::is_enabled()) {
        p.mutable_grad() = g.clone();
        return torch::zeros({}, torch::kFloat64);
      }
      TORCH_CHECK(++*evaluations != throwing_evaluation, "out of memory");
      return (p.detach() - opt.history(0).newest()).pow(2).sum();
    };
  }
};

TEST(AADL, SafeguardRejectsAWorseExtrapolation) {
  AADLBesidePlainSGD run;
  for (int step = 0; step < 6; ++step) {
    run.opt.step(run.closure_for(step));
    EXPECT_TRUE(torch::equal(run.p.detach(), run.q.detach())) << "step " << step;
  }
  EXPECT_GT(run.opt.rejected(), 0);
  EXPECT_EQ(run.opt.accepted(), 0);
}

// A placement whose buffers refuse to be acquired (and so overwritten) while `failing` is
// set: a tiered store that cannot load a chunk, a device out of memory in the pass. With
// `only_numel` >= 0, only the buffers of that many elements refuse.
class FlakyPlacement final : public tidepool::optim::StatePlacement {
 public:
  explicit FlakyPlacement(bool reuse = false) : reuse_(reuse) {}
  bool failing = false;
  int64_t only_numel = -1;
  std::unique_ptr<tidepool::optim::StateBuffer> create(const torch::Tensor& initial) override {
    return std::make_unique<Buffer>(initial, *this);
  }
  std::string name() const override { return "flaky"; }
  bool reuse_dropped_buffers() const override { return reuse_; }

 private:
  class Buffer final : public tidepool::optim::StateBuffer {
   public:
    Buffer(const torch::Tensor& initial, const FlakyPlacement& owner)
        : StateBuffer(initial.sizes(), initial.options()), owner_(owner),
          tensor_(initial.clone()) {}

   private:
    torch::Tensor do_acquire() override {
      TORCH_CHECK(!owner_.failing ||
                      (owner_.only_numel >= 0 && tensor_.numel() != owner_.only_numel),
                  "flaky placement: cannot load");
      return tensor_;
    }
    void do_release(torch::Tensor&, bool) override {}
    torch::Tensor do_read_host() const override { return tensor_.clone(); }
    const FlakyPlacement& owner_;
    torch::Tensor tensor_;
  };
  bool reuse_;
};

// Note [A failed push]: the columns and the Gram matrix stay in step. With buffers reused
// (Note [Reusing dropped columns]), the failed push keeps the column it stored as the
// spare, and the failed replacement fails writing over it: still nothing changes.
class AFailedPushOrReplace : public ::testing::TestWithParam<bool> {};

TEST_P(AFailedPushOrReplace, LeavesTheHistoryAsItWas) {
  auto placement = std::make_shared<FlakyPlacement>(/*reuse=*/GetParam());
  AndersonHistory history(4, placement);
  torch::manual_seed(3);
  std::vector<torch::Tensor> pushed;
  for (int i = 0; i < 4; ++i) {
    pushed.push_back(torch::randn({50}, torch::kFloat64));
    history.push(pushed.back());
  }
  const torch::Tensor gram = history.gram().clone(), rhs = history.rhs().clone();
  placement->failing = true;
  expect_error_mentions([&] { history.push(torch::randn({50}, torch::kFloat64)); }, "flaky");
  expect_error_mentions([&] { history.replace_newest(torch::randn({50}, torch::kFloat64)); },
                        "flaky");
  placement->failing = false;
  EXPECT_EQ(history.size(), 4);
  EXPECT_TRUE(torch::equal(history.gram(), gram));
  EXPECT_TRUE(torch::equal(history.rhs(), rhs));
  EXPECT_TRUE(torch::equal(history.newest(), pushed.back()));
  // And it goes on exactly as a history that never saw the failures.
  AndersonHistory clean(4, std::make_shared<tidepool::optim::ResidentPlacement>());
  for (const auto& x : pushed) clean.push(x);
  const torch::Tensor next = torch::randn({50}, torch::kFloat64);
  history.push(next);
  clean.push(next);
  EXPECT_TRUE(torch::equal(history.gram(), clean.gram()));
  EXPECT_TRUE(torch::equal(history.rhs(), clean.rhs()));
  history.replace_newest(next * 0.5);  // over the spare, when reused
  clean.replace_newest(next * 0.5);
  EXPECT_TRUE(torch::equal(history.gram(), clean.gram()));
  EXPECT_TRUE(torch::equal(history.rhs(), clean.rhs()));
  EXPECT_TRUE(torch::equal(history.newest(), clean.newest()));
}

INSTANTIATE_TEST_SUITE_P(ReusingBuffers, AFailedPushOrReplace, ::testing::Bool());

TEST(AADL, AClosureThatThrowsInTheSafeguardLeavesThePlainIterate) {
  AADLBesidePlainSGD run;
  for (int step = 0; step < 6; ++step) {
    const bool accelerates = run.opt.history(0).size() >= 2;
    // The safeguard's second evaluation is the accelerated iterate's.
    run.throwing_evaluation = accelerates ? 2 : 0;
    const AADL::LossClosure closure = run.closure_for(step);
    if (accelerates) {
      expect_error_mentions([&] { run.opt.step(closure); }, "out of memory");
      EXPECT_TRUE(torch::equal(run.p.detach(), run.q.detach())) << "step " << step;
      return;
    }
    run.opt.step(closure);
    EXPECT_TRUE(torch::equal(run.p.detach(), run.q.detach())) << "step " << step;
  }
  FAIL() << "no step accelerated";
}

// The safeguard accepts the accelerated iterate, and then storing it in place of the newest
// vector fails (a tiered chunk that cannot load): the history keeps the plain iterate
// (Note [A failed push]), and so must the parameters, or the two disagree on where the
// step left them.
TEST(AADL, AFailedStoreOfTheAcceptedIterateLeavesThePlainIterate) {
  auto placement = std::make_shared<FlakyPlacement>();
  torch::manual_seed(5);
  auto p = torch::randn({40}, torch::kFloat64).set_requires_grad(true);
  AADL opt(sgd(p), AADLOptions().relaxation(1.0).history_depth(4), placement);
  for (int step = 0; step < 6; ++step) {
    const bool accelerates = opt.history(0).size() >= 2;
    auto evaluations = std::make_shared<int>(0);
    const AADL::LossClosure closure = [&, evaluations] {
      if (torch::GradMode::is_enabled()) {
        p.mutable_grad() = torch::sin(p.detach() * (step + 1));
        return torch::zeros({}, torch::kFloat64);
      }
      // The accelerated iterate (the second evaluation) looks better: it is accepted.
      if (++*evaluations == 2) {
        placement->failing = true;
        return torch::zeros({}, torch::kFloat64);
      }
      return torch::ones({}, torch::kFloat64);
    };
    if (!accelerates) {
      opt.step(closure);
      continue;
    }
    const int64_t stored = opt.history(0).size();
    expect_error_mentions([&] { opt.step(closure); }, "flaky placement: cannot load");
    placement->failing = false;
    EXPECT_EQ(opt.accepted(), 0);
    EXPECT_EQ(opt.history(0).size(), std::min<int64_t>(stored + 1, 4));
    EXPECT_TRUE(torch::equal(p.detach(), opt.history(0).newest()));
    return;
  }
  FAIL() << "no step accelerated";
}

// Group 0's safeguard closure throws (out of memory in a forward pass), so the groups after
// it make this step's store before the error goes on; group 1's store fails too (its
// chunks cannot load). Group 2 still stores this step's vector, or its history would hold
// other steps than group 0's for good.
TEST(AADL, AFailedStoreInOneGroupLeavesTheStoresOfTheGroupsAfterIt) {
  auto placement = std::make_shared<FlakyPlacement>();
  torch::manual_seed(7);
  std::vector<torch::Tensor> params;
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (const int64_t n : {6, 5, 4}) {
    params.push_back(torch::randn({n}, torch::kFloat64).requires_grad_());
    groups.emplace_back(std::vector<torch::Tensor>{params.back()});
  }
  AADL opt(std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.1)),
           AADLOptions().relaxation(1.0).history_depth(4), placement);
  for (int step = 0; step < 6; ++step) {
    const bool accelerates = opt.history(0).size() >= 2;
    const AADL::LossClosure closure = [&] {
      if (torch::GradMode::is_enabled()) {
        for (auto& p : params) p.mutable_grad() = torch::sin(p.detach() * (step + 1));
        return torch::zeros({}, torch::kFloat64);
      }
      placement->failing = true;  // group 1's chunks refuse to load from now on
      placement->only_numel = 5;
      TORCH_CHECK(false, "out of memory");
      return torch::Tensor();
    };
    if (!accelerates) {
      opt.step(closure);
      continue;
    }
    const int64_t stored1 = opt.history(1).size(), stored2 = opt.history(2).size();
    expect_error_mentions([&] { opt.step(closure); }, "out of memory");
    placement->failing = false;
    EXPECT_EQ(opt.history(1).size(), stored1);
    EXPECT_EQ(opt.history(2).size(), std::min<int64_t>(stored2 + 1, 4));
    EXPECT_TRUE(torch::equal(opt.history(2).newest(), params[2].detach()));
    return;
  }
  FAIL() << "no step accelerated";
}

// Diverged parameters in one group: a c10::Error naming the group and saying what happened
// (not the solver's "A or B contains NaN or Inf"), after every group stepped and stored and
// the finite group was accelerated exactly as it is on its own.
TEST(AADL, ADivergedGroupIsNamedAfterEveryGroupStepped) {
  torch::manual_seed(5);
  const torch::Tensor start0 = torch::randn({6}, torch::kFloat64);
  const torch::Tensor start1 = torch::randn({4}, torch::kFloat64);
  const auto options = AADLOptions().history_depth(3).wait_iterations(0).relaxation(0.5);
  torch::Tensor p0 = start0.clone().requires_grad_(), p1 = start1.clone().requires_grad_();
  torch::Tensor q1 = start1.clone().requires_grad_();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{p0});
  groups.emplace_back(std::vector<torch::Tensor>{p1});
  AADL both(std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.1)),
            options);
  AADL alone(sgd(q1), options);
  const auto step = [](AADL& opt, const std::vector<torch::Tensor>& params) {
    opt.zero_grad();
    torch::Tensor loss = torch::zeros({}, torch::kFloat64);
    for (const auto& p : params) loss = loss + (p * p * p * p).sum() - p.sum();
    loss.backward();
    opt.step();
  };
  for (int i = 0; i < 3; ++i) {
    step(both, {p0, p1});
    step(alone, {q1});
  }
  ASSERT_TRUE(torch::equal(p1, q1));
  {
    torch::NoGradGuard no_grad;
    p0[2] = std::numeric_limits<double>::quiet_NaN();
  }
  for (int i = 0; i < 2; ++i) {
    expect_error_mentions([&] { step(both, {p0, p1}); }, "parameter group(s) 0 holds NaN");
    step(alone, {q1});
    EXPECT_TRUE(torch::equal(p1, q1)) << "step " << i;
    EXPECT_EQ(both.history(0).size(), 3);
    EXPECT_EQ(both.history(1).size(), 3);
  }
  expect_error_mentions([&] { step(both, {p0, p1}); }, "diverged");
}

// Group 0 diverged and group 1's safeguard closure then ran out of memory: the error that
// goes on is the closure's, and it says that group 0 diverged too (it was reported only
// when no group threw).
TEST(AADL, AnErrorOfALaterGroupStillNamesTheDivergedGroup) {
  torch::manual_seed(6);
  torch::Tensor p0 = torch::randn({6}, torch::kFloat64).requires_grad_();
  torch::Tensor p1 = torch::randn({4}, torch::kFloat64).requires_grad_();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>{p0});
  groups.emplace_back(std::vector<torch::Tensor>{p1});
  AADL opt(std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.1)),
           AADLOptions().history_depth(3).wait_iterations(0).relaxation(0.5));
  bool out_of_memory = false;
  const AADL::LossClosure closure = [&] {
    if (torch::GradMode::is_enabled()) {
      for (auto& p : {p0, p1}) p.mutable_grad() = torch::sin(p.detach());
      return torch::zeros({}, torch::kFloat64);
    }
    TORCH_CHECK(!out_of_memory, "CUDA out of memory in the forward pass");
    return torch::zeros({}, torch::kFloat64);
  };
  for (int i = 0; i < 3; ++i) opt.step(closure);
  {
    torch::NoGradGuard no_grad;
    p0[2] = std::numeric_limits<double>::quiet_NaN();
  }
  out_of_memory = true;
  try {
    opt.step(closure);
    FAIL() << "the step did not throw";
  } catch (const c10::Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("CUDA out of memory in the forward pass"), std::string::npos)
        << message;
    EXPECT_NE(message.find("parameter group(s) 0 holds NaN"), std::string::npos) << message;
  }
  EXPECT_EQ(opt.history(0).size(), 3);
  EXPECT_EQ(opt.history(1).size(), 3);
}

TEST(AADL, HistoryPlacementDoesNotChangeAnyBit) {
  const auto run = [](std::shared_ptr<tidepool::optim::StatePlacement> placement) {
    torch::manual_seed(11);
    auto p = torch::randn({300}, torch::kFloat32).set_requires_grad(true);
    AADL opt(sgd(p), AADLOptions().relaxation(0.5).history_depth(5), placement);
    for (int step = 0; step < 12; ++step) {
      p.mutable_grad() = torch::tanh(p.detach()) - 0.1;
      opt.step();
    }
    return p.detach().clone();
  };
  const torch::Tensor resident = run(std::make_shared<tidepool::optim::ResidentPlacement>());
  const torch::Tensor staged = run(std::make_shared<tidepool::optim::HostStagedPlacement>());
  EXPECT_TRUE(torch::equal(resident, staged));
}

TEST(AADL, LoadRejectsAnArchiveOfAnotherOptimizer) {
  auto p = torch::zeros({3}, torch::kFloat64).set_requires_grad(true);
  torch::optim::SGD plain({p}, torch::optim::SGDOptions(0.1));
  const std::string bytes = archive_bytes(plain);
  AADL opt(sgd(p));
  expect_error_mentions([&] { load_archive_bytes(opt, bytes); }, "aadl_format");
}

// ---- load: replaces everything, or changes nothing ---------------------------------------

std::shared_ptr<torch::optim::SGD> sgd_with_momentum(
    std::vector<torch::optim::OptimizerParamGroup> groups, double lr) {
  return std::make_shared<torch::optim::SGD>(std::move(groups),
                                             torch::optim::SGDOptions(lr).momentum(0.9));
}

void quadratic_step(AADL& opt, const std::vector<torch::Tensor>& params) {
  opt.zero_grad();
  torch::Tensor loss = torch::zeros({}, torch::kFloat64);
  for (const auto& p : params) loss = loss + (p * p).sum() + torch::sin(3 * p).sum();
  loss.backward();
  opt.step();
}

// LibTorch's optimizers load into their state, keeping that of parameters the archive has
// none for: loading a checkpoint saved before the first step into an AADL that had
// stepped kept its momentum buffers, and it went on unlike a fresh optimizer loaded alike.
TEST(AADL, LoadReplacesTheInnerStateAsInAFreshOptimizer) {
  const torch::Tensor start = torch::linspace(-1.0, 1.0, 6, torch::kFloat64);
  auto p = start.clone().set_requires_grad(true);
  AADL used(sgd_with_momentum({torch::optim::OptimizerParamGroup({p})}, 0.1),
            AADLOptions().history_depth(3));
  const std::string before_any_step = archive_bytes(used);
  quadratic_step(used, {p});
  quadratic_step(used, {p});
  auto q = start.clone().set_requires_grad(true);
  AADL fresh(sgd_with_momentum({torch::optim::OptimizerParamGroup({q})}, 0.1),
             AADLOptions().history_depth(3));
  load_archive_bytes(used, before_any_step);
  load_archive_bytes(fresh, before_any_step);
  EXPECT_TRUE(used.inner().state().empty()) << "the momentum of the steps before stayed";
  {
    torch::NoGradGuard no_grad;
    p.copy_(start);
  }
  for (int step = 0; step < 4; ++step) {
    quadratic_step(used, {p});
    quadratic_step(fresh, {q});
    ASSERT_TRUE(torch::equal(p.detach(), q.detach())) << "step " << step;
  }
}

// The archive's group 1 has two parameters, the optimizer's one. The history did not show
// it (saved before any vector was stored), so the inner SGD loaded: it took group 0's
// options, then refused group 1 and left them there. And parameters of other shapes but
// the same total size loaded, momentum buffers and all, and the next step threw.
TEST(AADL, ALoadOfOtherParametersIsRefusedAndChangesNothing) {
  const auto param = [](at::IntArrayRef shape) {
    return torch::ones(shape, torch::kFloat64).set_requires_grad(true);
  };
  auto a = param({3}), b = param({2}), c = param({2});
  AADL other_count(sgd_with_momentum({torch::optim::OptimizerParamGroup({a}),
                                      torch::optim::OptimizerParamGroup({b, c})},
                                     0.5),
                   AADLOptions().history_depth(3).store_each_nth(2));
  quadratic_step(other_count, {a, b, c});  // the second call would store the first vector
  auto d = param({3}), e = param({4});
  AADL target(sgd_with_momentum({torch::optim::OptimizerParamGroup({d}),
                                 torch::optim::OptimizerParamGroup({e})},
                                0.1),
              AADLOptions().history_depth(3));
  quadratic_step(target, {d, e});
  expect_error_mentions([&] { load_archive_bytes(target, archive_bytes(other_count)); },
                        "parameters");
  EXPECT_DOUBLE_EQ(target.inner().param_groups()[0].options().get_lr(), 0.1);

  auto f = param({2, 3});
  AADL other_shape(sgd_with_momentum({torch::optim::OptimizerParamGroup({f})}, 0.1));
  quadratic_step(other_shape, {f});
  auto g = param({3, 2});
  AADL transposed(sgd_with_momentum({torch::optim::OptimizerParamGroup({g})}, 0.1));
  quadratic_step(transposed, {g});
  expect_error_mentions(
      [&] { load_archive_bytes(transposed, archive_bytes(other_shape)); }, "shape");
  quadratic_step(transposed, {g});
}

// An inner optimizer whose load throws after it took the archive's state and options.
class SGDThatFailsAfterLoading : public torch::optim::SGD {
 public:
  using torch::optim::SGD::SGD;
  bool fail = false;
  void load(torch::serialize::InputArchive& archive) override {
    torch::optim::SGD::load(archive);
    TORCH_CHECK(!fail, "cannot load");
  }
};

TEST(AADL, AnInnerLoadThatThrowsLeavesTheOptimizerAsItWas) {
  const auto run = [](std::shared_ptr<torch::optim::SGD> inner, torch::Tensor p, int steps) {
    auto opt = std::make_unique<AADL>(std::move(inner), AADLOptions().history_depth(4));
    for (int step = 0; step < steps; ++step) quadratic_step(*opt, {p});
    return opt;
  };
  auto p = torch::linspace(-1.0, 1.0, 5, torch::kFloat64).set_requires_grad(true);
  auto q = p.detach().clone().set_requires_grad(true);
  auto failing = std::make_shared<SGDThatFailsAfterLoading>(
      std::vector<torch::Tensor>{p}, torch::optim::SGDOptions(0.1).momentum(0.9));
  auto target = run(failing, p, 4);
  auto twin = run(sgd_with_momentum({torch::optim::OptimizerParamGroup({q})}, 0.1), q, 4);
  auto r = torch::zeros({5}, torch::kFloat64).set_requires_grad(true);
  const std::string other = archive_bytes(
      *run(sgd_with_momentum({torch::optim::OptimizerParamGroup({r})}, 0.3), r, 2));
  failing->fail = true;
  expect_error_mentions([&] { load_archive_bytes(*target, other); }, "cannot load");
  EXPECT_DOUBLE_EQ(target->inner().param_groups()[0].options().get_lr(), 0.1);
  ASSERT_EQ(target->history(0).size(), twin->history(0).size());
  EXPECT_TRUE(torch::equal(target->history(0).gram(), twin->history(0).gram()));
  for (int step = 0; step < 4; ++step) {
    quadratic_step(*target, {p});
    quadratic_step(*twin, {q});
    ASSERT_TRUE(torch::equal(p.detach(), q.detach())) << "step " << step;
  }
}

}  // namespace
