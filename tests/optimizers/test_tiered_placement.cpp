// Optimizer state in the tiered store, on the host backend (its "device" is host memory
// LibTorch's CPU ops can use): Apollo's step pipeline (the recorded order replayed as a
// prefetch schedule more than one parameter ahead, write-back on release, everything kept
// resident when it fits) and AADL's history streamed chunk by chunk under a budget smaller
// than the history, loaded ahead of every pass also when each vector is one chunk (and
// left with nothing held when a step throws), or before a forward pass run outside step()
// through AADL::prefetch(); a full history writes each new vector over the buffers of
// one it dropped, creating none (StateBuffer::overwrite, in every placement). Every case
// must give bitwise the same parameters as resident state.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "allocator/backend.h"
#include "expect_error.h"
#include "optimizers/aadl.h"
#include "optimizers/anderson_history.h"
#include "optimizers/apollo.h"
#include "optimizers/state_placement.h"
#include "optimizers/tiered_placement.h"
#include "store_with_budget.h"
#include "tiering/tiered_store.h"

namespace {

using tidepool::TieredStore;
using tidepool::TieredStoreOptions;
using tidepool::testing::store_with_budget;
using tidepool::optim::AndersonHistory;
using tidepool::optim::StatePlacement;
using tidepool::optim::TieredPlacement;
using tidepool::optim::WriteBack;

constexpr int kParams = 8;
constexpr int64_t kElements = 256;  // fp32: 1 KiB per state tensor, 3 KiB per parameter

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

std::shared_ptr<TieredPlacement> writing_back_on_release(std::shared_ptr<TieredStore> store);

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
  auto store = store_with_budget(*backend, budget);
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
  // Apollo's state starts as the store's own zeros: nothing was copied in.
  EXPECT_EQ(placement->counters().created_through_host + placement->counters().created_on_device,
            0u);
}

TEST(TieredApollo, TwoOptimizersShareOneStoreEachOnItsOwnSchedule) {
  // A GAN-like pair stepping in turn on one store (one budget): each placement replays
  // its own recorded order, so every replayed step's loads are its own state, prefetched.
  // Each optimizer's own run with resident state, for comparison.
  auto resident_run = [](int seed_offset) {
    torch::manual_seed(5);
    std::vector<torch::Tensor> a, b;
    for (int i = 0; i < kParams; ++i) a.push_back(torch::randn({kElements}, torch::kFloat32));
    for (int i = 0; i < kParams; ++i) b.push_back(torch::randn({kElements}, torch::kFloat32));
    auto& params = seed_offset == 0 ? a : b;
    for (auto& p : params) p.set_requires_grad(true);
    tidepool::optim::Apollo apollo(params, tidepool::optim::ApolloOptions(0.01).warmup(3),
                                   std::make_shared<tidepool::optim::ResidentPlacement>());
    for (int step = 1; step <= 5; ++step) {
      for (auto& p : params) p.mutable_grad() = torch::sin(p.detach() * step) + 0.1 * p.detach();
      apollo.step();
    }
    std::vector<torch::Tensor> out;
    for (const auto& p : params) out.push_back(p.detach().clone());
    return out;
  };
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 12 * 1024);  // a quarter of the two optimizers' state
  auto placement_a = std::make_shared<TieredPlacement>(store);
  auto placement_b = std::make_shared<TieredPlacement>(store);

  torch::manual_seed(5);
  std::vector<torch::Tensor> params_a, params_b;
  for (int i = 0; i < kParams; ++i) {
    params_a.push_back(torch::randn({kElements}, torch::kFloat32).set_requires_grad(true));
  }
  for (int i = 0; i < kParams; ++i) {
    params_b.push_back(torch::randn({kElements}, torch::kFloat32).set_requires_grad(true));
  }
  const auto options = tidepool::optim::ApolloOptions(0.01).warmup(3);
  tidepool::optim::Apollo a(params_a, options, placement_a);
  tidepool::optim::Apollo b(params_b, options, placement_b);
  std::uint64_t misses_after_both_replayed = 0;
  for (int step = 1; step <= 5; ++step) {
    for (auto* pair : {&params_a, &params_b}) {
      for (auto& p : *pair) p.mutable_grad() = torch::sin(p.detach() * step) + 0.1 * p.detach();
    }
    const auto before = store->stats().misses;
    a.step();
    b.step();
    if (step > 2) misses_after_both_replayed += store->stats().misses - before;
  }
  std::vector<torch::Tensor> tiered_a, tiered_b;
  for (const auto& p : params_a) tiered_a.push_back(p.detach().clone());
  for (const auto& p : params_b) tiered_b.push_back(p.detach().clone());
  EXPECT_TRUE(all_equal(resident_run(0), tiered_a));
  EXPECT_TRUE(all_equal(resident_run(1), tiered_b));
  // Once both orders are recorded (and which step follows which), every acquire finds
  // its state loaded ahead, the first parameter's of each step too: the end of one
  // optimizer's step prefetches the start of the other's. (With one schedule shared by
  // both, half the acquires of the replayed steps missed when this was built.)
  EXPECT_EQ(misses_after_both_replayed, 0u);
  EXPECT_LE(store->stats().device_peak_bytes, 12u * 1024u);
}

TEST(TieredApollo, AStoreOutlivingItsOptimizersKeepsNoSchedulesOfTheDeadOnes) {
  // A sweep in one process: one store, one optimizer after another.
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 12 * 1024);
  EXPECT_EQ(store->schedule_count(), 1u);  // the store's own key
  for (int run = 0; run < 3; ++run) {
    torch::manual_seed(run);
    std::vector<torch::Tensor> params;
    for (int i = 0; i < kParams; ++i) {
      params.push_back(torch::randn({kElements}, torch::kFloat32).set_requires_grad(true));
    }
    tidepool::optim::Apollo apollo(params, tidepool::optim::ApolloOptions(0.01),
                                   std::make_shared<TieredPlacement>(store));
    for (int step = 1; step <= 2; ++step) {
      for (auto& p : params) p.mutable_grad() = torch::cos(p.detach() * step);
      apollo.step();
    }
    EXPECT_EQ(store->schedule_count(), 2u);
    EXPECT_GT(store->stats().handles, 0u);
  }
  EXPECT_EQ(store->schedule_count(), 1u);
  EXPECT_EQ(store->stats().handles, 0u);
}

TEST(TieredApollo, StateThatFitsStaysResidentAfterTheFirstStep) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 64 * 1024);  // room for all 24 KiB
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
  auto store = store_with_budget(*backend, 12 * 1024);
  auto placement = std::make_shared<TieredPlacement>(store, tidepool::Stream{},
                                                     TIDEPOOL_TAG_OPTIMIZER_STATE,
                                                     WriteBack::on_demand);
  const auto tiered = train_apollo(placement, 4);
  EXPECT_TRUE(all_equal(train_apollo(std::make_shared<tidepool::optim::ResidentPlacement>(), 4),
                        tiered));
  EXPECT_GT(store->stats().evictions, 0u);
}

// Review finding: a parameter whose m, B and d together exceed the store's budget failed
// at its third acquire, after every parameter before it had stepped, at every step.
TEST(TieredApollo, AParameterWhoseStateCannotBeHeldAtOnceIsRefusedBeforeAnythingSteps) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 2 * 1024);  // two 1 KiB buffers, not three
  auto placement = std::make_shared<TieredPlacement>(store);
  auto small = torch::full({16}, 0.5, torch::kFloat32).set_requires_grad(true);
  auto large = torch::full({kElements}, 0.5, torch::kFloat32).set_requires_grad(true);
  tidepool::optim::Apollo apollo({small, large}, tidepool::optim::ApolloOptions(0.01),
                                 placement);
  small.mutable_grad() = torch::ones_like(small);
  large.mutable_grad() = torch::ones_like(large);
  tidepool::testing::expect_error_mentions([&] { apollo.step(); }, "at least 3072 bytes");
  EXPECT_TRUE(torch::equal(small.detach(), torch::full({16}, 0.5, torch::kFloat32)));
  EXPECT_TRUE(apollo.state().empty());
  // Without the large parameter's gradient the step goes ahead.
  large.mutable_grad() = torch::Tensor();
  apollo.step();
  EXPECT_FALSE(torch::equal(small.detach(), torch::full({16}, 0.5, torch::kFloat32)));
}

// The next group's first parameter is loaded while the group before it finishes: in the
// first step, before the store has a schedule, only Apollo's own prefetch loads ahead (it
// stopped at each group's end).
TEST(TieredApollo, TheFirstStepLoadsTheNextGroupsFirstParameterAhead) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 64 * 1024);
  auto placement = std::make_shared<TieredPlacement>(store);
  auto a = torch::full({kElements}, 0.5, torch::kFloat32).set_requires_grad(true);
  auto b = torch::full({kElements}, 0.5, torch::kFloat32).set_requires_grad(true);
  tidepool::optim::Apollo apollo({torch::optim::OptimizerParamGroup({a}),
                                  torch::optim::OptimizerParamGroup({b})},
                                 tidepool::optim::ApolloOptions(0.01), placement);
  a.mutable_grad() = torch::ones_like(a);
  b.mutable_grad() = torch::ones_like(b);
  apollo.step();
  EXPECT_EQ(store->stats().prefetch_hits, 3u) << "b's m, B and d, loaded while a stepped";
}

TEST(TieredPlacement, NullStoreIsRejected) {
  tidepool::testing::expect_error_mentions([] { TieredPlacement placement(nullptr); }, "null");
}

TEST(TieredPlacement, BuffersAreCountedAndUncounted) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 4096);
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

// Note [Creating on the device] (tiered_placement.cpp): zeros are made in the store's host
// memory, so a new optimizer's state moves no byte and takes no device memory.
TEST(TieredPlacement, ZerosAreMadeInHostMemoryWithoutACopy) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 4096);
  TieredPlacement placement(store);
  auto zeros = placement.create_zeros({3, 100}, torch::TensorOptions().dtype(torch::kFloat64));
  EXPECT_EQ(zeros->sizes(), torch::IntArrayRef({3, 100}));
  EXPECT_EQ(zeros->options().dtype(), torch::kFloat64);
  EXPECT_EQ(placement.live_bytes(), 2400u);
  EXPECT_TRUE(torch::equal(zeros->read_host(), torch::zeros({3, 100}, torch::kFloat64)));
  store->synchronize();
  const auto stats = store->stats();
  EXPECT_EQ(stats.copy.h2d.bytes + stats.copy.d2h.bytes, 0u);
  EXPECT_EQ(stats.device_peak_bytes, 0u);
  EXPECT_EQ(placement.counters().created_on_device + placement.counters().created_through_host,
            0u);
}

// The route CUDA tensors take (made on the device, filled there, written back by the
// store's D2H stream), run on the host backend: the same contents as through host memory,
// the write-back counted in the store's copy stats, and through host memory after all
// when the budget has no room for it now.
TEST(TieredPlacement, CreatingOnTheDeviceWritesBackThroughTheStore) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 1024);  // one 1 KiB buffer on the device at a time
  auto placement = writing_back_on_release(store);
  placement->set_initial_copy(tidepool::optim::InitialCopy::on_device);
  const torch::Tensor ones = torch::ones({256}, torch::kFloat32);
  auto a = placement->create(ones);
  store->synchronize();
  EXPECT_EQ(store->stats().copy.d2h.bytes, 1024u) << "the new contents go back through the store";
  EXPECT_EQ(store->stats().resident_handles, 0u) << "written back on release";
  EXPECT_TRUE(torch::equal(a->read_host(), ones));
  EXPECT_EQ(placement->counters().created_on_device, 1u);
  {
    tidepool::optim::StateLease held(*a);  // the whole budget
    EXPECT_TRUE(torch::equal(held.tensor(), ones));
    auto b = placement->create(torch::full({256}, 2.0f));
    EXPECT_EQ(placement->counters().created_through_host, 1u) << "no room on the device";
    EXPECT_TRUE(torch::equal(b->read_host(), torch::full({256}, 2.0f)));
    held.release(/*dirty=*/false);
  }
  EXPECT_LE(store->stats().device_peak_bytes, 1024u);
}

// A store whose pinned budget is spent puts host copies in pageable memory; the placement
// says how much of its state is there (the benchmarks report it: every copy of it runs
// at pageable speed).
TEST(TieredPlacement, PageableHostCopiesAreCounted) {
  auto backend = tidepool::make_host_backend();
  const auto store_with_pinned = [&](std::size_t pinned_budget) {
    TieredStoreOptions options;
    options.device_budget_bytes = std::size_t{16} << 20;
    options.host.pinned_budget_bytes = pinned_budget;
    options.host.respect_memlock_limit = false;
    options.host.warn_on_pageable_fallback = false;
    return std::make_shared<TieredStore>(*backend, options);
  };
  const auto four_mib = torch::TensorOptions().dtype(torch::kFloat32);
  const int64_t elements = int64_t{1} << 20;  // a direct mapping of its own: no mimalloc
  {
    TieredPlacement pinned(store_with_pinned(std::size_t{64} << 20));
    auto buffer = pinned.create_zeros({elements}, four_mib);
    EXPECT_EQ(pinned.pageable_bytes(), 0u);
  }
  TieredPlacement starved(store_with_pinned(1024));
  {
    auto buffer = starved.create_zeros({elements}, four_mib);
    auto copied = starved.create(torch::ones({100}, torch::kFloat32));
    EXPECT_EQ(starved.pageable_bytes(), (std::size_t{4} << 20) + 400u);
    EXPECT_GT(starved.store().stats().host.pageable_allocs, 0u);
    EXPECT_TRUE(torch::equal(copied->read_host(), torch::ones({100}, torch::kFloat32)));
  }
  EXPECT_EQ(starved.pageable_bytes(), 0u);
}

TEST(StateLease, AFailedAcquireLeavesNothingAcquired) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 1024);  // one 1 KiB buffer at a time
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

// A buffer whose first `failures` releases throw (a host-staged buffer's copy back under a
// CUDA error).
class ReleaseFailsOnce final : public tidepool::optim::StateBuffer {
 public:
  explicit ReleaseFailsOnce(int failures = 1)
      : StateBuffer({4}, torch::kFloat32), failures_(failures), contents_(torch::zeros({4})) {}
  int releases = 0;
  std::vector<bool> dirty_flags;  // of every release tried

 private:
  torch::Tensor do_acquire() override { return contents_; }
  void do_release(torch::Tensor&, bool dirty) override {
    dirty_flags.push_back(dirty);
    TORCH_CHECK(releases++ >= failures_, "copy back failed");
  }
  int failures_;
  torch::Tensor do_read_host() const override { return contents_.clone(); }
  torch::Tensor contents_;
};

// Review finding: StateLease::release let go of its buffer before releasing it, so a
// release that threw left the buffer acquired for good (its destructor could no longer
// release it): every later step failed with "acquire called twice", and no checkpoint could
// read the state. The lease now keeps the buffer until its release went through; its
// destructor tries that release again (dirty: the update kept when the copy goes now), and
// if that fails too, a clean one, which ends the acquire.
TEST(StateLease, AReleaseThatThrowsIsRetriedByTheLeasesDestructor) {
  ReleaseFailsOnce buffer(1);
  {
    tidepool::optim::StateLease lease(buffer);
    tidepool::testing::expect_error_mentions([&] { lease.release(/*dirty=*/true); },
                                             "copy back failed");
  }
  EXPECT_FALSE(buffer.acquired());
  EXPECT_EQ(buffer.dirty_flags, (std::vector<bool>{true, true}));  // the update kept
  tidepool::optim::StateLease again(buffer);  // the next step acquires it
  again.release(/*dirty=*/false);

  ReleaseFailsOnce failing_twice(2);
  {
    tidepool::optim::StateLease lease(failing_twice);
    EXPECT_THROW(lease.release(/*dirty=*/true), c10::Error);
  }
  EXPECT_FALSE(failing_twice.acquired());
  EXPECT_EQ(failing_twice.dirty_flags, (std::vector<bool>{true, true, false}));
}

// A write-back on release whose copy to the host fails: the release throws, and stands
// (StateBuffer::do_after_release): the buffer is not left acquired, and its contents are
// the store's device copy, which the next acquire and read_host find.
TEST(StateBuffer, AWriteBackThatFailsStillReleasesTheBuffer) {
  auto backend = tidepool::make_host_backend();
  auto placement = writing_back_on_release(store_with_budget(*backend, 1 << 20));
  auto buffer = placement->create_zeros({256}, torch::kFloat32);
  buffer->acquire().fill_(1.0f);
  backend->inject_fault(tidepool::FaultPoint::copy, 1);
  try {
    buffer->release(/*dirty=*/true);
    ADD_FAILURE() << "the failed write-back was not reported";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("copy back to the host failed"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(buffer->acquired());
  EXPECT_TRUE(torch::equal(buffer->read_host(), torch::ones({256})));
  EXPECT_TRUE(torch::equal(buffer->acquire(), torch::ones({256})));
  buffer->release(/*dirty=*/false);  // written back now
  EXPECT_FALSE(placement->store().resident(1));
  EXPECT_TRUE(torch::equal(buffer->read_host(), torch::ones({256})));
}

// StateBuffer::overwrite in every placement: the new contents, wherever the old ones were
// (a tiered handle on the device or written back), with no handle created; refused while
// acquired or for a tensor of another shape.
TEST(StateBuffer, OverwriteReplacesTheContentsInEveryPlacement) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 4096);
  auto through_host = std::make_shared<TieredPlacement>(store);
  auto on_device = writing_back_on_release(store);
  on_device->set_initial_copy(tidepool::optim::InitialCopy::on_device);
  const std::vector<std::shared_ptr<StatePlacement>> placements = {
      std::make_shared<tidepool::optim::ResidentPlacement>(),
      std::make_shared<tidepool::optim::HostStagedPlacement>(), through_host, on_device};
  const torch::Tensor twos = torch::full({256}, 2.0f);
  for (const auto& placement : placements) {
    SCOPED_TRACE(placement->name());
    auto buffer = placement->create(torch::ones({256}, torch::kFloat32));
    const std::size_t handles = store->stats().handles;
    buffer->prefetch();  // a loaded (or staged) copy of the old contents must not survive
    buffer->overwrite(twos);
    EXPECT_TRUE(torch::equal(buffer->read_host(), twos));
    EXPECT_TRUE(torch::equal(tidepool::optim::StateLease(*buffer).tensor(), twos));
    buffer->overwrite(torch::full({256}, 3.0f));  // after a load
    EXPECT_TRUE(torch::equal(tidepool::optim::StateLease(*buffer).tensor(),
                             torch::full({256}, 3.0f)));
    EXPECT_EQ(store->stats().handles, handles);
    tidepool::testing::expect_error_mentions([&] { buffer->overwrite(torch::ones({255})); },
                                             "shape");
    tidepool::optim::StateLease held(*buffer);
    tidepool::testing::expect_error_mentions([&] { buffer->overwrite(twos); }, "acquired");
  }
  EXPECT_EQ(through_host->counters().overwritten_through_host, 2u);
  EXPECT_EQ(on_device->counters().overwritten_on_device, 2u);
  EXPECT_TRUE(through_host->reuse_dropped_buffers());
  EXPECT_FALSE(placements[0]->reuse_dropped_buffers());
}

// LibTorch's OpenMP workers spin between ops and starve the host backend's copy threads
// on a small machine (measured on 2 cores: 36 s instead of 1.5 s): one compute thread
// while this lives.
class OneComputeThread {
 public:
  OneComputeThread() : threads_(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneComputeThread() { at::set_num_threads(threads_); }
  OneComputeThread(const OneComputeThread&) = delete;
  OneComputeThread& operator=(const OneComputeThread&) = delete;

 private:
  int threads_;
};

// Fills a history of n-element vectors: `pushes` iterates of a contraction (past the
// depth, the ring drops the oldest), the newest replaced, then an extrapolation over all.
torch::Tensor fill_history(AndersonHistory& history, int64_t n, int64_t pushes,
                           std::uint64_t seed) {
  torch::manual_seed(seed);
  torch::Tensor x = torch::randn({n}, torch::kFloat32);
  for (int64_t i = 0; i < pushes; ++i) {
    x = x - 0.1f * torch::tanh(x) + 0.01f * static_cast<float>(i);
    history.push(x);
  }
  history.replace_newest(x * 0.999f);
  return history.combine(torch::linspace(-0.5, 0.5, history.depth() - 1, torch::kFloat64));
}

// `fill` run on `tiered` and on a resident history of its depth gives bitwise the same
// extrapolation, matrices and newest vector.
void expect_history_matches_resident(
    AndersonHistory& tiered, const std::function<torch::Tensor(AndersonHistory&)>& fill) {
  AndersonHistory resident(tiered.depth(), std::make_shared<tidepool::optim::ResidentPlacement>());
  EXPECT_TRUE(torch::equal(fill(tiered), fill(resident))) << "the extrapolation";
  EXPECT_TRUE(torch::equal(tiered.gram(), resident.gram())) << "the Gram matrix";
  EXPECT_TRUE(torch::equal(tiered.rhs(), resident.rhs())) << "the right-hand side";
  EXPECT_TRUE(torch::equal(tiered.newest(), resident.newest())) << "the newest vector";
}

// AADL's history, tiered under a budget smaller than the history: each pass holds about
// two chunks per vector on the device, never all the vectors; the matrices and the
// extrapolation are bitwise those of a resident history.
TEST(TieredAADL, HistoryStreamsInChunksUnderABudgetSmallerThanTheHistory) {
  const OneComputeThread one_thread;
  // 4 stored chunks per vector (the last one short), 5 vectors: 5 × 12 MiB of history.
  const int64_t n = 3 * AndersonHistory::kStoreChunk + 1000;
  const int64_t depth = 5;
  const std::size_t chunk_bytes = AndersonHistory::kStoreChunk * sizeof(float);
  const std::size_t history_bytes = depth * static_cast<std::size_t>(n) * sizeof(float);
  const std::size_t budget = 2 * depth * chunk_bytes + (1 << 20);
  ASSERT_LT(budget, history_bytes);
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, budget);
  auto placement = std::make_shared<TieredPlacement>(store);
  AndersonHistory tiered(depth, placement);
  // One push more than fits: the ring drops one.
  expect_history_matches_resident(
      tiered, [&](AndersonHistory& history) { return fill_history(history, n, depth + 1, 3); });
  const auto stats = store->stats();
  EXPECT_LE(stats.device_peak_bytes, budget);
  EXPECT_LE(placement->peak_device_bytes(), budget);
  EXPECT_GT(stats.evictions, 0u);
  EXPECT_GT(stats.prefetch_issued, 0u);
}

// Review finding: a history placement whose budget could not hold one chunk of every
// stored vector at once failed the push after the inner step, every step once the history
// was that long (here from the fifth): the parameters moved, the history stopped growing,
// and the store's error named no budget. Refused before anything runs.
TEST(TieredAADL, AHistoryBudgetTooSmallForOnePassIsRefusedBeforeAnythingSteps) {
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 3 * 1000 * sizeof(float));  // 3 of 5 vectors
  auto placement = std::make_shared<TieredPlacement>(store);
  auto w = torch::full({1000}, 0.5, torch::kFloat32).set_requires_grad(true);
  auto inner = std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{w},
                                                   torch::optim::SGDOptions(0.1));
  tidepool::optim::AADL aadl(inner, tidepool::optim::AADLOptions().history_depth(5), placement);
  w.mutable_grad() = torch::ones_like(w);
  tidepool::testing::expect_error_mentions([&] { aadl.step(); }, "at least 20000 bytes");
  EXPECT_TRUE(torch::equal(w.detach(), torch::full({1000}, 0.5, torch::kFloat32)));
  EXPECT_EQ(aadl.history(0).size(), 0);
}

// The same history with every vector entering the store the way CUDA vectors do (made
// on the device and written back by the store, Note [Creating on the device]): the same
// bits, and each stored vector crosses back exactly once, counted in the store's stats,
// also when it was written over the buffers of a dropped one (Note [Reusing dropped
// columns] in anderson_history.h).
TEST(TieredAADL, VectorsCreatedOnTheDeviceAreWrittenBackOnceAndChangeNoBit) {
  const OneComputeThread one_thread;
  const int64_t n = 2 * AndersonHistory::kStoreChunk + 1000;  // 3 stored chunks per vector
  const int64_t depth = 4;
  const std::size_t chunk_bytes = AndersonHistory::kStoreChunk * sizeof(float);
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 2 * depth * chunk_bytes);
  auto placement = writing_back_on_release(store);
  placement->set_initial_copy(tidepool::optim::InitialCopy::on_device);
  AndersonHistory tiered(depth, placement);
  expect_history_matches_resident(
      tiered, [&](AndersonHistory& history) { return fill_history(history, n, depth + 2, 4); });
  store->synchronize();
  const std::uint64_t stored = depth + 3;  // pushes and the replacement
  // The first push into a full ring made the spare column; every later vector was
  // written over the column dropped before it.
  const auto& counters = placement->counters();
  EXPECT_EQ(counters.created_on_device, 3u * (depth + 1));
  EXPECT_EQ(counters.overwritten_on_device, 3u * (stored - depth - 1));
  EXPECT_EQ(counters.created_through_host + counters.overwritten_through_host, 0u);
  EXPECT_EQ(store->stats().handles, 3u * (depth + 1)) << "the history's columns and the spare";
  EXPECT_EQ(store->stats().copy.d2h.bytes, stored * n * sizeof(float));
  EXPECT_LE(store->stats().device_peak_bytes, 2 * depth * chunk_bytes);
}

// ---- AADL with a single-chunk history: loaded ahead of every pass -----------------------

constexpr int64_t kAADLDepth = 5;
constexpr int64_t kAADLElements = 3000;  // one group, far below one stored chunk

// What a closure should do at one step (for the failure cases).
struct ClosurePlan {
  int throw_in_gradient_call_at = 0;  // step whose forward/backward (inside the inner step) throws
  int throw_in_safeguard_at = 0;      // step whose safeguard evaluation throws
};

// One vector trained with AADL around SGD on a separable non-convex loss.
struct AADLProblem {
  explicit AADLProblem(const std::shared_ptr<StatePlacement>& placement)
      : p((torch::manual_seed(7), torch::randn({kAADLElements}, torch::kFloat32))
              .set_requires_grad(true)),
        curvature(torch::linspace(0.2, 2.0, kAADLElements)),
        aadl(std::make_shared<torch::optim::SGD>(std::vector<torch::Tensor>{p},
                                                 torch::optim::SGDOptions(0.2)),
             tidepool::optim::AADLOptions().relaxation(0.5).history_depth(kAADLDepth),
             placement) {}

  torch::Tensor loss() const {
    return (0.5f * curvature * p * p + 0.3f * torch::sin(2.0f * p)).sum();
  }

  torch::Tensor p;
  torch::Tensor curvature;
  tidepool::optim::AADL aadl;
};

// Trains the AADLProblem with a closure (so the safeguard runs and the inner step runs
// the forward/backward). `in_forward(step)` runs inside every gradient evaluation; steps
// that throw (plan) are checked to throw and leave nothing acquired.
torch::Tensor train_aadl(const std::shared_ptr<StatePlacement>& placement, int steps,
                         const ClosurePlan& plan = {},
                         const std::function<void(int)>& in_forward = {},
                         const std::function<void()>& after_throw = {}) {
  AADLProblem problem(placement);
  tidepool::optim::AADL& aadl = problem.aadl;
  for (int step = 1; step <= steps; ++step) {
    const auto closure = [&] {
      const bool gradient = torch::GradMode::is_enabled();
      if (gradient && in_forward) in_forward(step);
      if ((gradient && step == plan.throw_in_gradient_call_at) ||
          (!gradient && step == plan.throw_in_safeguard_at)) {
        throw std::runtime_error("closure failed on purpose");
      }
      if (gradient) aadl.zero_grad();
      torch::Tensor loss = problem.loss();
      if (gradient) loss.backward();
      return loss;
    };
    if (step == plan.throw_in_gradient_call_at || step == plan.throw_in_safeguard_at) {
      EXPECT_THROW(aadl.step(closure), std::runtime_error) << "step " << step;
      if (after_throw) after_throw();
    } else {
      aadl.step(closure);
    }
  }
  EXPECT_GT(aadl.accepted() + aadl.rejected(), 0) << "the safeguard never ran";
  return problem.p.detach().clone();
}

// A placement that writes the history back as soon as a pass releases it, so it lives on
// the host between uses and whatever is on the device during a forward pass was loaded
// ahead for the step.
std::shared_ptr<TieredPlacement> writing_back_on_release(std::shared_ptr<TieredStore> store) {
  return std::make_shared<TieredPlacement>(std::move(store), tidepool::Stream{},
                                           TIDEPOOL_TAG_OPTIMIZER_STATE, WriteBack::on_release);
}

// Vectors the first pass of `step` reads (from step 3, when three vectors are held): the
// s − 1 stored before, but the oldest once the history is full.
std::size_t first_pass_vectors(int step) {
  return static_cast<std::size_t>(std::min<int64_t>(step - 1, kAADLDepth - 1));
}

// Note [Loading the history ahead of use]: with every vector a single stored chunk there
// is no "chunk c+1" to load while chunk c is computed; the chunks each pass reads must be
// on their way before it starts. Every acquire finds its chunk prefetched, the vectors
// the step's first pass reads are loading while the forward/backward runs, the budget of
// two chunks per vector holds, and no bit changes.
TEST(TieredAADL, SingleChunkHistoryIsLoadedAheadOfEveryPass) {
  const OneComputeThread one_thread;
  static_assert(kAADLElements < AndersonHistory::kStoreChunk);
  const int steps = 12;
  const torch::Tensor resident =
      train_aadl(std::make_shared<tidepool::optim::ResidentPlacement>(), steps);

  const std::size_t vector_bytes = kAADLElements * sizeof(float);
  const std::size_t budget = 2 * kAADLDepth * vector_bytes;
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, budget);
  auto placement = writing_back_on_release(store);
  // Loaded (or loading) while the inner step's forward/backward runs, per step.
  std::vector<std::size_t> loaded_in_forward;
  const torch::Tensor tiered = train_aadl(placement, steps, {}, [&](int) {
    loaded_in_forward.push_back(store->stats().resident_handles);
  });
  EXPECT_TRUE(torch::equal(resident, tiered));

  ASSERT_EQ(loaded_in_forward.size(), static_cast<size_t>(steps));
  for (int step = 3; step <= steps; ++step) {
    EXPECT_GE(loaded_in_forward[step - 1], first_pass_vectors(step))
        << "step " << step << ": the history was not loading during the forward pass";
  }
  const auto stats = store->stats();
  EXPECT_GT(stats.acquires, 0u);
  EXPECT_EQ(stats.prefetch_hits, stats.acquires) << "an acquire found its chunk not loading";
  EXPECT_EQ(stats.misses, 0u);
  EXPECT_EQ(stats.prefetch_skipped, 0u) << "two chunks per vector must hold every prefetch";
  EXPECT_GT(stats.evictions, 0u) << "on_release: the history lives on the host between uses";
  EXPECT_LE(stats.device_peak_bytes, budget);
  EXPECT_LE(placement->peak_device_bytes(), budget);
}

// A trainer that runs forward and backward itself, then calls step() without a closure:
// AADL::prefetch() before the forward pass loads the history the step reads first while
// that pass runs (without it, nothing is on its way then), and changes no bit.
torch::Tensor train_aadl_outside_step(const std::shared_ptr<StatePlacement>& placement,
                                      int steps, bool prefetch_before_forward,
                                      const std::function<void(int)>& in_forward = {}) {
  AADLProblem problem(placement);
  for (int step = 1; step <= steps; ++step) {
    if (prefetch_before_forward) problem.aadl.prefetch();
    problem.aadl.zero_grad();
    if (in_forward) in_forward(step);
    problem.loss().backward();
    problem.aadl.step();
  }
  return problem.p.detach().clone();
}

TEST(TieredAADL, PrefetchBeforeAForwardPassOutsideStepLoadsTheHistoryThen) {
  const OneComputeThread one_thread;
  const int steps = 8;
  const torch::Tensor resident = train_aadl_outside_step(
      std::make_shared<tidepool::optim::ResidentPlacement>(), steps, false);
  for (const bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "with prefetch()" : "without prefetch()");
    const std::size_t budget = 2 * kAADLDepth * kAADLElements * sizeof(float);
    auto backend = tidepool::make_host_backend();
    auto store = store_with_budget(*backend, budget);
    auto placement = writing_back_on_release(store);
    std::vector<std::size_t> loaded_in_forward;
    const torch::Tensor tiered = train_aadl_outside_step(placement, steps, prefetch, [&](int) {
      store->synchronize();  // what was started by now has arrived
      loaded_in_forward.push_back(store->stats().resident_handles);
    });
    EXPECT_TRUE(torch::equal(resident, tiered));
    ASSERT_EQ(loaded_in_forward.size(), static_cast<size_t>(steps));
    for (int step = 3; step <= steps; ++step) {
      if (prefetch) {
        EXPECT_GE(loaded_in_forward[step - 1], first_pass_vectors(step)) << "step " << step;
      } else {
        EXPECT_EQ(loaded_in_forward[step - 1], 0u) << "step " << step;
      }
    }
    EXPECT_LE(store->stats().device_peak_bytes, budget);
  }
}

// A budget of exactly one chunk per vector (what a pass must hold at once): loading ahead
// must neither push the store over it nor leave a pass without room, and stays exact.
TEST(TieredAADL, SingleChunkHistoryInTheSmallestBudgetStaysExact) {
  const OneComputeThread one_thread;
  const int steps = 10;
  const std::size_t budget = kAADLDepth * kAADLElements * sizeof(float);
  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, budget);
  auto placement = writing_back_on_release(store);
  EXPECT_TRUE(
      torch::equal(train_aadl(std::make_shared<tidepool::optim::ResidentPlacement>(), steps),
                   train_aadl(placement, steps)));
  EXPECT_LE(store->stats().device_peak_bytes, budget);
}

// Host blocks the store has allocated (each create() allocates and zeroes one).
std::uint64_t host_blocks_allocated(TieredStore& store) {
  const auto stats = store.stats();
  return stats.host.pinned_allocs + stats.host.pageable_allocs;
}

// Note [Reusing dropped columns] (anderson_history.h): once the ring has been full, a step
// writes the vector it stores (and the replacement the safeguard keeps) over the buffers
// of one the history dropped, so the store allocates no host block and creates no handle
// in any later step, on both routes into the store, and no bit changes.
TEST(TieredAADL, AFullHistoryWritesOverTheBuffersItDropsInsteadOfCreatingNew) {
  const OneComputeThread one_thread;
  const int steps = 14;
  const torch::Tensor resident =
      train_aadl(std::make_shared<tidepool::optim::ResidentPlacement>(), steps);
  for (const auto route :
       {tidepool::optim::InitialCopy::automatic, tidepool::optim::InitialCopy::on_device}) {
    const bool on_device = route == tidepool::optim::InitialCopy::on_device;
    SCOPED_TRACE(on_device ? "filled on the device" : "written through host memory");
    auto backend = tidepool::make_host_backend();
    auto store = store_with_budget(*backend, 2 * kAADLDepth * kAADLElements * sizeof(float));
    auto placement = writing_back_on_release(store);
    placement->set_initial_copy(route);
    // Seen in each step's forward pass: what the steps before it allocated.
    std::vector<std::uint64_t> blocks_before;
    std::size_t most_handles = 0;
    const torch::Tensor tiered = train_aadl(placement, steps, {}, [&](int) {
      blocks_before.push_back(host_blocks_allocated(*store));
      most_handles = std::max(most_handles, store->stats().handles);
    });
    EXPECT_TRUE(torch::equal(resident, tiered));
    ASSERT_EQ(blocks_before.size(), static_cast<size_t>(steps));
    // Step depth + 1 is the first push into a full ring: from it on, one column is spare.
    const std::uint64_t when_full = blocks_before[kAADLDepth + 1];
    EXPECT_LE(when_full, static_cast<std::uint64_t>(kAADLDepth + 1));
    EXPECT_EQ(host_blocks_allocated(*store), when_full)
        << "a step after the ring was full created buffers";
    EXPECT_LE(most_handles, static_cast<std::size_t>(kAADLDepth + 1));
  }
}

// A step that throws after its history started loading (in the forward/backward, or in
// the safeguard's evaluation after the replace pass was hinted) leaves nothing acquired,
// later steps go on bitwise as with resident state, and destroying the optimizer frees
// every device byte the loads took.
TEST(TieredAADL, AStepThatThrowsAfterLoadingAheadLeavesNothingHeld) {
  const OneComputeThread one_thread;
  const int steps = 10;
  const ClosurePlan plan{.throw_in_gradient_call_at = 5, .throw_in_safeguard_at = 7};
  const torch::Tensor resident =
      train_aadl(std::make_shared<tidepool::optim::ResidentPlacement>(), steps, plan);

  auto backend = tidepool::make_host_backend();
  auto store = store_with_budget(*backend, 2 * kAADLDepth * kAADLElements * sizeof(float));
  auto placement = std::make_shared<TieredPlacement>(store);
  int throws = 0;
  const torch::Tensor tiered = train_aadl(placement, steps, plan, {}, [&] {
    ++throws;
    EXPECT_EQ(store->stats().acquired_handles, 0u);
  });
  EXPECT_EQ(throws, 2);
  EXPECT_TRUE(torch::equal(resident, tiered));
  EXPECT_GT(store->stats().prefetch_hits, 0u);
  store->synchronize();
  const auto after = store->stats();
  EXPECT_EQ(after.handles, 0u);
  EXPECT_EQ(after.device_bytes, 0u);
}

}  // namespace
