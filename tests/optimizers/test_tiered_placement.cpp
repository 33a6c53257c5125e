// Optimizer state in the tiered store, on the host backend (its "device" is host memory
// LibTorch's CPU ops can use): Apollo's step pipeline (the recorded order replayed as a
// prefetch schedule more than one parameter ahead, write-back on release, everything kept
// resident when it fits) and AADL's history streamed chunk by chunk under a budget smaller
// than the history. Every case must give bitwise the same parameters as resident state.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <vector>

#include "allocator/backend.h"
#include "expect_error.h"
#include "optimizers/anderson_history.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "tiering/tiered_store.h"

namespace {

using tidepool::TieredStore;
using tidepool::TieredStoreOptions;
using tidepool::optim::AndersonHistory;
using tidepool::optim::StatePlacement;
using tidepool::optim::TieredPlacement;
using tidepool::optim::WriteBack;

constexpr int kParams = 8;
constexpr int64_t kElements = 256;  // fp32: 1 KiB per state tensor, 3 KiB per parameter

std::shared_ptr<TieredStore> host_store(tidepool::Backend& backend, std::size_t budget) {
  TieredStoreOptions options;
  options.device_budget_bytes = budget;
  return std::make_shared<TieredStore>(backend, options);
}

// kParams parameters trained with Apollo for `steps` steps; `after_step` sees each step.
std::vector<torch::Tensor> train_apollo(const std::shared_ptr<StatePlacement>& placement,
                                        int steps,
                                        const std::function<void(int)>& after_step = {}) {
  torch::manual_seed(5);
  std::vector<torch::Tensor> params;
  for (int i = 0; i < kParams; ++i) {
    params.push_back(torch::randn({kElements}, torch::kFloat32).set_requires_grad(true));
  }
  tidepool::optim::Apollo apollo(params, tidepool::optim::ApolloOptions(0.01).warmup(3),
                                 placement);
  for (int step = 1; step <= steps; ++step) {
    for (auto& p : params) p.mutable_grad() = torch::sin(p.detach() * step) + 0.1 * p.detach();
    apollo.step();
    if (after_step) after_step(step);
  }
  std::vector<torch::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().clone());
  return out;
}

bool all_equal(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!torch::equal(a[i], b[i])) return false;
  }
  return true;
}

TEST(TieredApollo, PipelinePrefetchesAlongTheRecordedOrderAndWritesBackOnRelease) {
  const auto resident =
      train_apollo(std::make_shared<tidepool::optim::ResidentPlacement>(), 5);

  auto backend = tidepool::make_host_backend();
  const std::size_t budget = 12 * 1024;  // 4 of the 8 parameters' state
  auto store = host_store(*backend, budget);
  auto placement = std::make_shared<TieredPlacement>(store);
  std::vector<std::size_t> resident_after;
  const auto tiered = train_apollo(placement, 5, [&](int) {
    resident_after.push_back(store->stats().resident_handles);
  });
  EXPECT_TRUE(all_equal(resident, tiered));

  const auto stats = store->stats();
  EXPECT_GT(stats.evictions, 0u) << "24 KiB of state in a 12 KiB budget must be written back";
  EXPECT_GT(stats.prefetch_hits, 0u);
  // After a replayed step the schedule has already loaded the next step's first
  // parameters: more than the one parameter (3 handles) Apollo itself prefetches.
  ASSERT_EQ(resident_after.size(), 5u);
  EXPECT_GT(resident_after.back(), 3u);
  EXPECT_LE(stats.device_peak_bytes, budget);
  EXPECT_GT(placement->peak_device_bytes(), 3u * 1024u);
  EXPECT_LE(placement->peak_device_bytes(), budget);
}

TEST(TieredApollo, StateThatFitsStaysResidentAfterTheFirstStep) {
  auto backend = tidepool::make_host_backend();
  auto store = host_store(*backend, 64 * 1024);  // room for all 24 KiB
  auto placement = std::make_shared<TieredPlacement>(store);
  std::uint64_t loaded_after_first = 0;
  tidepool::TieredStoreStats last;  // taken before the optimizer (and its state) goes
  const auto tiered = train_apollo(placement, 4, [&](int step) {
    store->synchronize();
    if (step == 1) loaded_after_first = store->stats().copy.h2d.bytes;
    last = store->stats();
  });
  EXPECT_TRUE(all_equal(train_apollo(std::make_shared<tidepool::optim::ResidentPlacement>(), 4),
                        tiered));
  EXPECT_EQ(placement->write_back(), WriteBack::automatic);
  EXPECT_EQ(last.evictions, 0u);
  EXPECT_EQ(last.copy.h2d.bytes, loaded_after_first) << "resident state was moved again";
  EXPECT_EQ(last.copy.d2h.bytes, 0u);
  EXPECT_EQ(last.resident_handles, 3u * kParams);
}

TEST(TieredApollo, WriteBackOnDemandKeepsStateUntilTheRoomIsNeeded) {
  auto backend = tidepool::make_host_backend();
  auto store = host_store(*backend, 12 * 1024);
  auto placement = std::make_shared<TieredPlacement>(store, tidepool::Stream{},
                                                     TIDEPOOL_TAG_OPTIMIZER_STATE,
                                                     WriteBack::on_demand);
  const auto tiered = train_apollo(placement, 4);
  EXPECT_TRUE(all_equal(train_apollo(std::make_shared<tidepool::optim::ResidentPlacement>(), 4),
                        tiered));
  EXPECT_GT(store->stats().evictions, 0u);
}

TEST(TieredPlacement, NullStoreIsRejected) {
  tidepool::testing::expect_error_mentions([] { TieredPlacement placement(nullptr); }, "null");
}

TEST(TieredPlacement, BuffersAreCountedAndUncounted) {
  auto backend = tidepool::make_host_backend();
  auto store = host_store(*backend, 4096);
  TieredPlacement placement(store);
  {
    auto a = placement.create(torch::ones({100}, torch::kFloat64));
    auto b = placement.create(torch::ones({28}, torch::kFloat32));
    EXPECT_EQ(placement.live_bytes(), 800u + 112u);
    EXPECT_TRUE(torch::equal(a->read_host(), torch::ones({100}, torch::kFloat64)));
  }
  EXPECT_EQ(placement.live_bytes(), 0u);
  EXPECT_EQ(store->stats().handles, 0u);
}

TEST(StateLease, AFailedAcquireLeavesNothingAcquired) {
  auto backend = tidepool::make_host_backend();
  auto store = host_store(*backend, 1024);  // one 1 KiB buffer at a time
  TieredPlacement placement(store);
  auto a = placement.create(torch::ones({256}, torch::kFloat32));
  auto b = placement.create(torch::full({256}, 2.0f));
  EXPECT_THROW(
      {
        tidepool::optim::StateLease first(*a);
        tidepool::optim::StateLease second(*b);  // no room: a is held
      },
      std::exception);
  EXPECT_FALSE(a->acquired());
  EXPECT_FALSE(b->acquired());
  {
    tidepool::optim::StateLease lease(*b);
    EXPECT_TRUE(b->acquired());
    EXPECT_TRUE(torch::equal(lease.tensor(), torch::full({256}, 2.0f)));
    lease.release(/*dirty=*/false);
    EXPECT_FALSE(b->acquired());
    tidepool::testing::expect_error_mentions([&] { lease.release(false); }, "twice");
  }
}

// AADL's history, tiered under a budget smaller than the history: each pass holds about
// two chunks per vector on the device, never all the vectors; the matrices and the
// extrapolation are bitwise those of a resident history.
TEST(TieredAADL, HistoryStreamsInChunksUnderABudgetSmallerThanTheHistory) {
  // LibTorch's OpenMP workers spin between ops and starve the host backend's copy threads
  // on a small machine (measured on 2 cores: 36 s instead of 1.5 s); one thread here.
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  struct RestoreThreads {
    int n;
    ~RestoreThreads() { at::set_num_threads(n); }
  } restore{threads};
  // 4 stored chunks per vector (the last one short), 5 vectors: 5 × 12 MiB of history.
  const int64_t n = 3 * AndersonHistory::kStoreChunk + 1000;
  const int64_t depth = 5;
  const auto fill = [&](AndersonHistory& history) {
    torch::manual_seed(3);
    torch::Tensor x = torch::randn({n}, torch::kFloat32);
    for (int64_t i = 0; i < depth + 1; ++i) {  // one more than fits: the ring drops one
      x = x - 0.1f * torch::tanh(x) + 0.01f * static_cast<float>(i);
      history.push(x);
    }
    history.replace_newest(x * 0.999f);
    return history.combine(torch::linspace(-0.5, 0.5, depth - 1, torch::kFloat64));
  };
  const std::size_t chunk_bytes = AndersonHistory::kStoreChunk * sizeof(float);
  const std::size_t history_bytes = depth * static_cast<std::size_t>(n) * sizeof(float);
  const std::size_t budget = 2 * depth * chunk_bytes + (1 << 20);
  ASSERT_LT(budget, history_bytes);
  auto backend = tidepool::make_host_backend();
  auto store = host_store(*backend, budget);
  auto placement = std::make_shared<TieredPlacement>(store);
  AndersonHistory tiered(depth, placement);
  AndersonHistory resident(depth, std::make_shared<tidepool::optim::ResidentPlacement>());
  EXPECT_TRUE(torch::equal(fill(tiered), fill(resident)));
  EXPECT_TRUE(torch::equal(tiered.gram(), resident.gram()));
  EXPECT_TRUE(torch::equal(tiered.rhs(), resident.rhs()));
  EXPECT_TRUE(torch::equal(tiered.newest(), resident.newest()));
  const auto stats = store->stats();
  EXPECT_LE(stats.device_peak_bytes, budget);
  EXPECT_LE(placement->peak_device_bytes(), budget);
  EXPECT_GT(stats.evictions, 0u);
  EXPECT_GT(stats.prefetch_issued, 0u);
}

}  // namespace
