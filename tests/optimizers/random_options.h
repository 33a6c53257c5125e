// Random options of Apollo and AADL for the randomized optimizer tests (tiered vs resident
// placement, checkpoints), and how a failure names them: one distribution of valid options
// for every test that draws them, so each covers the same option space.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "optimizers/aadl.h"
#include "optimizers/apollo.h"

namespace tidepool::testing {

// lr 0.01 or 0.1, beta 0.9 or 0.5, warmup 0..5, either rebound, half of them with weight
// decay of one of the three types, some with an init_lr other than the default.
inline optim::ApolloOptions random_apollo_options(std::mt19937_64& rng) {
  const auto pick = [&](std::uint64_t n) { return static_cast<int64_t>(rng() % n); };
  const auto percent = [&](int p) { return pick(100) < p; };
  optim::ApolloOptions o(percent(50) ? 0.01 : 0.1);
  o.beta(percent(50) ? 0.9 : 0.5).warmup(pick(6));
  o.rebound(percent(50) ? optim::ApolloRebound::constant : optim::ApolloRebound::belief);
  if (percent(50)) {
    o.weight_decay(1e-3);
    const optim::ApolloWeightDecay types[] = {optim::ApolloWeightDecay::L2,
                                              optim::ApolloWeightDecay::decoupled,
                                              optim::ApolloWeightDecay::stable};
    o.weight_decay_type(types[pick(3)]);
  }
  if (percent(30)) o.init_lr(o.lr() / 10);
  return o;
}

inline std::string describe(const optim::ApolloOptions& o) {
  return "lr " + std::to_string(o.lr()) + " beta " + std::to_string(o.beta()) + " warmup " +
         std::to_string(o.warmup()) +
         (o.init_lr() ? " init_lr " + std::to_string(*o.init_lr()) : std::string()) + " " +
         optim::to_string(o.rebound()) + " wd " + std::to_string(o.weight_decay()) +
         (o.weight_decay_type() ? std::string(" ") + optim::to_string(*o.weight_decay_type())
                                : std::string());
}

// Either acceleration type, relaxation 0.1/0.5/1, waiting 0..3, history depth 3..7, every
// first or second iterate stored, accelerating every 1..3 steps, with or without reg_acc.
inline optim::AADLOptions random_aadl_options(std::mt19937_64& rng) {
  const auto pick = [&](std::uint64_t n) { return static_cast<int64_t>(rng() % n); };
  const double relaxations[] = {0.1, 0.5, 1.0};
  optim::AADLOptions o;
  o.acceleration_type(pick(2) == 0 ? optim::AndersonType::anderson
                                   : optim::AndersonType::anderson_normal_equation)
      .relaxation(relaxations[pick(3)])
      .wait_iterations(pick(4))
      .history_depth(3 + pick(5))
      .store_each_nth(1 + pick(2))
      .frequency(1 + pick(3))
      .reg_acc(pick(2) == 0 ? 0.0 : 1e-6);
  return o;
}

inline std::string describe(const optim::AADLOptions& o) {
  return "depth " + std::to_string(o.history_depth()) + ", " +
         optim::to_string(o.acceleration_type()) + ", relaxation " +
         std::to_string(o.relaxation()) + ", wait " + std::to_string(o.wait_iterations()) +
         ", every " + std::to_string(o.store_each_nth()) + "th stored, frequency " +
         std::to_string(o.frequency()) + ", reg " + std::to_string(o.reg_acc());
}

}  // namespace tidepool::testing
