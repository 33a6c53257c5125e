// Apollo's tiered state after a checkpoint is loaded into it: the restored state is
// created beside the state it replaces, so with a pinned budget for one copy of the state
// it lands in pageable memory; the next step's loads move it into the pinned memory the
// replaced state freed (Note [Pageable blocks are promoted] in tiering/host_promotion.cpp),
// and the trajectory is bitwise the uninterrupted one. Host backend.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "archive_bytes.h"
#include "optimizers/apollo.h"
#include "optimizers/tiered_placement.h"
#include "tiering/tiered_store.h"

namespace {

using tidepool::TieredStore;
using tidepool::TieredStoreOptions;
using tidepool::optim::TieredPlacement;
using tidepool::optim::WriteBack;
using tidepool::testing::archive_bytes;
using tidepool::testing::load_archive_bytes;

constexpr int kParams = 4;
constexpr int64_t kElements = int64_t{1} << 20;  // fp32: 4 MiB per state tensor (direct)
constexpr std::size_t kStateBytes = std::size_t{3} * kParams * kElements * sizeof(float);

std::vector<torch::Tensor> make_params() {
  torch::manual_seed(11);
  std::vector<torch::Tensor> params;
  for (int i = 0; i < kParams; ++i) {
    params.push_back(torch::randn({kElements}, torch::kFloat32).set_requires_grad(true));
  }
  return params;
}

void step(tidepool::optim::Apollo& apollo, std::vector<torch::Tensor>& params, int n) {
  for (auto& p : params) p.mutable_grad() = torch::sin(p.detach() * n) + 0.1 * p.detach();
  apollo.step();
}

TEST(RestoredTieredState, MovesIntoPinnedMemoryAtTheNextStep) {
  auto backend = tidepool::make_host_backend();
  TieredStoreOptions options;
  options.device_budget_bytes = std::size_t{64} << 20;
  options.host.pinned_budget_bytes = kStateBytes + (std::size_t{4} << 20);  // one copy
  options.host.warn_on_pageable_fallback = false;
  auto store = std::make_shared<TieredStore>(*backend, options);
  auto placement = std::make_shared<TieredPlacement>(store, tidepool::Stream{},
                                                     TIDEPOOL_TAG_OPTIMIZER_STATE,
                                                     WriteBack::on_release);
  const auto apollo_options = tidepool::optim::ApolloOptions(0.01).warmup(2);

  auto uninterrupted = make_params();
  tidepool::optim::Apollo reference(uninterrupted, apollo_options);
  auto params = make_params();
  tidepool::optim::Apollo apollo(params, apollo_options, placement);
  for (int n = 1; n <= 3; ++n) {
    step(reference, uninterrupted, n);
    step(apollo, params, n);
  }
  ASSERT_EQ(placement->pageable_bytes(), 0u);

  load_archive_bytes(apollo, archive_bytes(apollo));
  EXPECT_GT(placement->pageable_bytes(), 0u) << "restored beside the state it replaced";
  EXPECT_EQ(store->stats().host.pageable_in_use_bytes, placement->pageable_bytes());

  for (int n = 4; n <= 5; ++n) {
    step(reference, uninterrupted, n);
    step(apollo, params, n);
  }
  const auto s = store->stats();
  EXPECT_EQ(placement->pageable_bytes(), 0u);
  EXPECT_EQ(s.host.pageable_in_use_bytes, 0u);
  EXPECT_GT(s.host_promotions, 0u);
  for (int i = 0; i < kParams; ++i) {
    EXPECT_TRUE(torch::equal(params[i].detach(), uninterrupted[i].detach())) << "parameter " << i;
  }
}

}  // namespace
