// tidepool.pinned_budget (or, without it, the default quarter of RAM) bounds the pinned host
// memory of the whole process, not of each HostArena (Note [One pinned budget per process]
// in tiering/pinned_budget.cpp): every tiered store owns an arena, and with one per optimizer
// a budget per arena let the process pin a multiple of it. The arenas whose budget comes
// from the configuration share it; what one gives back (a freed slab, a failed
// registration, the arena itself) another can pin; an arena given a budget of its own keeps
// it to itself.
#include <gtest/gtest.h>

#include <cstddef>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "tests/tiering/tiering_test_util.h"
#include "tiering/host_arena.h"

namespace tidepool {
namespace {

using tiering_test::ConfigScope;
using tiering_test::kMiB;

class SharedPinnedBudgetTest : public tiering_test::TieringTest {
 protected:
  // An arena whose budget is the configured one (or the default): no explicit budget.
  static HostArenaOptions configured_budget_options() {
    HostArenaOptions o;
    o.respect_memlock_limit = false;
    o.warn_on_pageable_fallback = false;
    return o;
  }
};

// Two arenas under tidepool.pinned_budget:64MiB: the first one's 64 MiB slab spends the
// budget, so the second falls back to pageable memory, for the budget; once the first is
// gone (its slab unregistered), the second pins again.
TEST_P(SharedPinnedBudgetTest, TheConfiguredBudgetIsOneForTheProcessNotOnePerArena) {
  const ConfigScope config("tidepool.pinned_budget:64MiB");
  auto first = std::make_unique<HostArena>(backend(), configured_budget_options());
  HostArena second(backend(), configured_budget_options());
  EXPECT_TRUE(second.stats().budget_from_config);

  const HostBlock a = first->allocate(4096);
  EXPECT_EQ(a.tier, HostTier::pinned) << first->stats().last_fallback_reason;
  const HostBlock b = second.allocate(4096);
  EXPECT_EQ(b.tier, HostTier::pageable) << "two arenas pinned twice the process's budget";
  const HostArenaStats s = second.stats();
  EXPECT_EQ(s.pageable_allocs, 1u);
  EXPECT_EQ(s.fallback_budget, 1u);
  EXPECT_NE(s.last_fallback_reason.find("budget"), std::string::npos) << s.last_fallback_reason;
  EXPECT_LE(first->stats().pinned_registered_bytes + s.pinned_registered_bytes, 64 * kMiB);

  second.deallocate(b);
  first->deallocate(a);
  first.reset();  // its slab is unregistered: the budget is free again
  const HostBlock c = second.allocate(4096);
  EXPECT_EQ(c.tier, HostTier::pinned) << second.stats().last_fallback_reason;
  second.deallocate(c);
}

// Arenas on several threads charging at once: exactly one gets the budget's one slab, the
// others cannot even map a page (it is spent) and fall back. Run under TSan in CI.
TEST_P(SharedPinnedBudgetTest, ArenasChargingAtOnceNeverTogetherPassTheBudget) {
  const ConfigScope config("tidepool.pinned_budget:64MiB");
  constexpr std::size_t kThreads = 4;
  std::vector<std::unique_ptr<HostArena>> arenas;
  for (std::size_t t = 0; t < kThreads; ++t)
    arenas.push_back(std::make_unique<HostArena>(backend(), configured_budget_options()));
  std::vector<HostBlock> blocks(kThreads);
  std::vector<std::thread> threads;
  std::latch start(kThreads);  // all charge together, not one by one as they are started
  for (std::size_t t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      start.arrive_and_wait();
      blocks[t] = arenas[t]->allocate(4096);
    });
  for (std::thread& th : threads) th.join();
  std::size_t pinned = 0;
  std::size_t registered = 0;
  for (std::size_t t = 0; t < kThreads; ++t) {
    if (blocks[t].tier == HostTier::pinned) ++pinned;
    registered += arenas[t]->stats().pinned_registered_bytes;
  }
  EXPECT_EQ(pinned, 1u);
  EXPECT_EQ(registered, 64 * kMiB);
  for (std::size_t t = 0; t < kThreads; ++t) arenas[t]->deallocate(blocks[t]);
}

// release_empty_slabs (the empty-cache hook) gives the budget back to the process, not only
// to the arena that released.
TEST_P(SharedPinnedBudgetTest, ReleasedSlabsGiveTheBudgetBackToOtherArenas) {
  const ConfigScope config("tidepool.pinned_budget:64MiB");
  HostArena first(backend(), configured_budget_options());
  HostArena second(backend(), configured_budget_options());
  const HostBlock a = first.allocate(4096);
  ASSERT_EQ(a.tier, HostTier::pinned) << first.stats().last_fallback_reason;
  first.deallocate(a);
  EXPECT_EQ(first.release_empty_slabs(), 64 * kMiB);
  const HostBlock b = second.allocate(4096);
  EXPECT_EQ(b.tier, HostTier::pinned) << second.stats().last_fallback_reason;
  second.deallocate(b);
}

// A registration that fails gives back the budget it was charged: the next request, with
// the backend working again, is pinned.
TEST_P(SharedPinnedBudgetTest, AFailedRegistrationGivesTheBudgetBack) {
  if (!on_host()) GTEST_SKIP() << "fault injection is a host-backend feature";
  const ConfigScope config("tidepool.pinned_budget:64MiB");
  HostArena arena(backend(), configured_budget_options());
  backend().inject_fault(FaultPoint::host_register, 1);
  const HostBlock failed = arena.allocate(4096);
  EXPECT_EQ(failed.tier, HostTier::pageable);
  EXPECT_EQ(arena.stats().fallback_register_failed, 1u);
  HostArena other(backend(), configured_budget_options());
  const HostBlock pinned = other.allocate(4096);
  EXPECT_EQ(pinned.tier, HostTier::pinned) << other.stats().last_fallback_reason;
  other.deallocate(pinned);
  arena.deallocate(failed);
}

// An arena given HostArenaOptions::pinned_budget_bytes keeps that budget to itself: it
// neither spends the configured one nor is limited by what the others hold.
TEST_P(SharedPinnedBudgetTest, AnExplicitBudgetIsTheArenasOwn) {
  const ConfigScope config("tidepool.pinned_budget:64MiB");
  HostArena shared(backend(), configured_budget_options());
  HostArena own(backend(), tiering_test::test_host_options(64 * kMiB));
  EXPECT_FALSE(own.stats().budget_from_config);
  const HostBlock a = own.allocate(4096);
  const HostBlock b = shared.allocate(4096);
  const HostBlock c = own.allocate(8 * kMiB);  // a direct mapping: over its own 64 MiB
  EXPECT_EQ(a.tier, HostTier::pinned) << own.stats().last_fallback_reason;
  EXPECT_EQ(b.tier, HostTier::pinned) << shared.stats().last_fallback_reason;
  EXPECT_EQ(c.tier, HostTier::pageable);
  for (const HostBlock& x : {a, c}) own.deallocate(x);
  shared.deallocate(b);
}

// The budget is read at each allocation: an arena built before the configuration is
// applied (a C++ program that builds its stores, then calls install_from_env) keeps to
// the configured budget from then on, as the pointer-stable ranges do.
TEST_P(SharedPinnedBudgetTest, AConfigurationAppliedAfterTheArenaIsBuiltHoldsForIt) {
  HostArena arena(backend(), configured_budget_options());  // the default: a quarter of RAM
  EXPECT_FALSE(arena.stats().budget_from_config);
  const ConfigScope config("tidepool.pinned_budget:0");  // nothing pinned
  const HostBlock b = arena.allocate(4096);
  EXPECT_EQ(b.tier, HostTier::pageable) << "the arena kept the budget it was built with";
  EXPECT_EQ(arena.pinned_budget_bytes(), 0u);
  const HostArenaStats s = arena.stats();
  EXPECT_TRUE(s.budget_from_config);
  EXPECT_EQ(s.fallback_budget, 1u);
  arena.deallocate(b);
}

INSTANTIATE_TEST_SUITE_P(Backends, SharedPinnedBudgetTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
