// Checks of the fused Apollo step shared by the CPU battery (test_apollo_fused.cpp) and the
// GPU one (gpu_test_optimizers.cpp), on tensors from one element to several grid strides of
// the fused partition (apollo_step_math.h), so that partial blocks and threads that visit
// more than one element are both covered:
//   - it follows the LibTorch-ops path, every rebound × decay in fp64, five steps;
//   - the carried sums (Note [carried sums]) change no bit against sums recomputed from
//     the state every step;
//   - a NaN gradient element gives NaN where the ops path does.
#pragma once

#include <gtest/gtest.h>

#include <limits>
#include <vector>

#include <torch/torch.h>

#include "optimizers/apollo.h"

namespace tidepool::testing {

// Two copies of the same parameters, each requiring grad, for two optimizers to step side
// by side. 600'007 elements: 1024 blocks of 256 threads on the device, so a thread visits
// up to 3 of them; 147 ranges on the host. On the device also 2'107'149 elements: a
// thread visits 8 or 9, two whole rounds of the kernels' unrolled walk and, for some, one
// element after them (Note [Loads in flight] in optimizers/apollo_kernels.cu).
struct TwinParams {
  std::vector<torch::Tensor> a, b;
  TwinParams(torch::Device device, torch::Dtype dtype) {
    const auto opts = torch::TensorOptions().dtype(dtype).device(device);
    a = {torch::randn({600007}, opts), torch::randn({7, 13}, opts), torch::randn({1}, opts),
         torch::randn({256}, opts)};
    if (device.is_cuda()) a.push_back(torch::randn({2107149}, opts));
    for (auto& t : a) {
      t.set_requires_grad(true);
      b.push_back(t.detach().clone().set_requires_grad(true));
    }
  }
};

inline void expect_fused_matches_ops(torch::Device device) {
  for (const char* rebound : {"constant", "belief"}) {
    for (const char* decay : {"L2", "decoupled", "stable"}) {
      torch::manual_seed(1);
      TwinParams twins(device, torch::kFloat64);
      std::vector<torch::Tensor>& fused_params = twins.a;
      std::vector<torch::Tensor>& ops_params = twins.b;
      auto options = optim::ApolloOptions(0.01).warmup(2).weight_decay(1e-2);
      options.rebound(rebound).weight_decay_type(decay);
      optim::Apollo fused(fused_params, options);
      optim::Apollo ops(ops_params, options);
      ops.set_fused_kernels(false);
      for (int step = 0; step < 5; ++step) {
        for (size_t i = 0; i < fused_params.size(); ++i) {
          fused_params[i].mutable_grad() = torch::sin(fused_params[i].detach() * (step + 1));
          ops_params[i].mutable_grad() = torch::sin(ops_params[i].detach() * (step + 1));
        }
        fused.step();
        ops.step();
      }
      for (size_t i = 0; i < fused_params.size(); ++i) {
        EXPECT_TRUE(torch::allclose(fused_params[i].detach(), ops_params[i].detach(), 1e-10, 1e-12))
            << rebound << "/" << decay << " tensor " << i << " on " << device;
      }
    }
  }
}

// Two optimizers on the same parameters, one of which forgets its carried sums before
// every step: the same bits after every step, for every rebound and each decay that keeps
// a carry. fp64, where a wrong last bit of a sum shows in the result (fp32 parameters get
// the step's scalars rounded to fp32, which hides most of them).
inline void expect_carried_sums_change_no_bit(torch::Device device) {
  for (const char* rebound : {"constant", "belief"}) {
    for (const char* decay : {"L2", "decoupled"}) {
      for (const double weight_decay : {0.0, 1e-2}) {
        torch::manual_seed(2);
        TwinParams twins(device, torch::kFloat64);
        std::vector<torch::Tensor>& carried_params = twins.a;
        std::vector<torch::Tensor>& fresh_params = twins.b;
        auto options = optim::ApolloOptions(0.01).warmup(2).weight_decay(weight_decay);
        options.rebound(rebound).weight_decay_type(decay);
        optim::Apollo carried(carried_params, options);
        optim::Apollo fresh(fresh_params, options);
        for (int step = 0; step < 4; ++step) {
          for (size_t i = 0; i < carried_params.size(); ++i) {
            carried_params[i].mutable_grad() = torch::cos(carried_params[i].detach() * (step + 2));
            fresh_params[i].mutable_grad() = torch::cos(fresh_params[i].detach() * (step + 2));
          }
          int reset = 0;
          for (auto& [key, state] : fresh.state()) {
            auto& apollo_state = static_cast<optim::ApolloParamState&>(*state);
            reset += apollo_state.carried_sums.defined() ? 1 : 0;
            apollo_state.carried_sums = torch::Tensor();
          }
          // From the second step on, every parameter has carried sums to forget.
          EXPECT_EQ(reset, step == 0 ? 0 : static_cast<int>(fresh_params.size()));
          carried.step();
          fresh.step();
          for (size_t i = 0; i < carried_params.size(); ++i) {
            EXPECT_TRUE(torch::equal(carried_params[i].detach(), fresh_params[i].detach()))
                << rebound << "/" << decay << " λ " << weight_decay << " step " << step
                << " tensor " << i << " on " << device;
          }
        }
      }
    }
  }
}

// A NaN in one gradient element: the reference's Σg·d, and so Δ, B, D and every parameter
// element, become NaN, and the ops path follows it. The fused step must too, not train
// on with D at its floor (a NaN B taken as below the rebound, a NaN |δ| dropped from σ).
inline void expect_a_nan_gradient_as_the_ops_path(torch::Device device) {
  for (const char* rebound : {"constant", "belief"}) {
    torch::manual_seed(4);
    TwinParams twins(device, torch::kFloat64);
    auto options = optim::ApolloOptions(0.01).warmup(0);
    options.rebound(rebound);
    optim::Apollo fused(twins.a, options);
    optim::Apollo ops(twins.b, options);
    ops.set_fused_kernels(false);
    for (int step = 0; step < 3; ++step) {
      for (auto* params : {&twins.a, &twins.b}) {
        for (auto& p : *params) {
          torch::Tensor g = torch::sin(p.detach() * (step + 1));
          if (step == 1) g.view(-1)[0] = std::numeric_limits<double>::quiet_NaN();
          p.mutable_grad() = g;
        }
      }
      fused.step();
      ops.step();
    }
    for (size_t i = 0; i < twins.a.size(); ++i) {
      EXPECT_TRUE(torch::isnan(twins.b[i].detach()).all().item<bool>())
          << rebound << " tensor " << i << ": the ops path no longer gives NaN";
      const torch::Tensor fused_nan = torch::isnan(twins.a[i].detach());
      EXPECT_TRUE(torch::equal(fused_nan, torch::isnan(twins.b[i].detach())))
          << rebound << " tensor " << i << " on " << device;
    }
  }
}

}  // namespace tidepool::testing
