// The configured budgets (tidepool.state_budget, tidepool.pinned_budget) are the
// defaults of TieredStore and HostArena; explicit options win; percentages resolve
// against the device's memory and the host's RAM (allocator/tier_routing.h).
#include <gtest/gtest.h>

#include "allocator/config.h"
#include "allocator/tier_routing.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/host_arena.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

// Applies a configuration for one test and restores the default one afterwards.
class ConfigBudgetsTest : public tiering_test::TieringTest {
 protected:
  void apply(const char* conf) { apply_config(claim_config(conf).config); }
  void TearDown() override { apply_config(Config{}); }
};

TEST_P(ConfigBudgetsTest, StateBudgetIsTheStoresDefaultDeviceBudget) {
  apply("tidepool.state_budget:3MiB");
  TieredStoreOptions o;
  o.host = tiering_test::test_host_options();
  TieredStore store(backend(), o);
  EXPECT_EQ(store.device_budget_bytes(), std::size_t{3} << 20);
  EXPECT_EQ(store.stats().device_budget_bytes, std::size_t{3} << 20);
}

TEST_P(ConfigBudgetsTest, StateBudgetPercentageIsOfTheDevicesMemory) {
  apply("tidepool.state_budget:25%");
  TieredStoreOptions o;
  o.host = tiering_test::test_host_options();
  TieredStore store(backend(), o);
  EXPECT_EQ(store.device_budget_bytes(), backend().mem_info().total_bytes / 4);
}

TEST_P(ConfigBudgetsTest, ExplicitDeviceBudgetWinsOverTheConfiguration) {
  apply("tidepool.state_budget:3MiB");
  TieredStoreOptions o;
  o.device_budget_bytes = 5 << 20;
  o.host = tiering_test::test_host_options();
  TieredStore store(backend(), o);
  EXPECT_EQ(store.device_budget_bytes(), std::size_t{5} << 20);
}

TEST_P(ConfigBudgetsTest, ZeroOrNoStateBudgetKeepsTheBuiltInDefault) {
  for (const char* conf : {"backend:tidepool", "tidepool.state_budget:0"}) {
    apply(conf);
    TieredStoreOptions o;
    o.host = tiering_test::test_host_options();
    TieredStore store(backend(), o);
    EXPECT_EQ(store.device_budget_bytes(), TieredStoreOptions::kDefaultDeviceBudget) << conf;
  }
  apply_config(Config{});  // tidepool not enabled: the configuration is not consulted
  TieredStoreOptions o;
  o.host = tiering_test::test_host_options();
  EXPECT_EQ(TieredStore(backend(), o).device_budget_bytes(),
            TieredStoreOptions::kDefaultDeviceBudget);
}

TEST_P(ConfigBudgetsTest, PinnedBudgetIsTheArenasDefaultAndIsEnforced) {
  apply("tidepool.pinned_budget:64MiB");
  HostArenaOptions o;
  o.respect_memlock_limit = false;
  HostArena arena(backend(), o);
  EXPECT_EQ(arena.pinned_budget_bytes(), std::size_t{64} << 20);
  EXPECT_TRUE(arena.stats().budget_from_config);
  // One 64 MiB slab fits; a direct mapping beyond it must fall back to pageable.
  HostBlock small = arena.allocate(4096);
  EXPECT_EQ(small.tier, HostTier::pinned);
  HostBlock large = arena.allocate(8 << 20);
  EXPECT_EQ(large.tier, HostTier::pageable);
  EXPECT_EQ(arena.stats().fallback_budget, 1u);
  arena.deallocate(small);
  arena.deallocate(large);
}

TEST_P(ConfigBudgetsTest, PinnedBudgetPercentageIsOfHostMemory) {
  apply("tidepool.pinned_budget:10%");
  HostArenaOptions o;
  o.respect_memlock_limit = false;
  HostArena arena(backend(), o);
  EXPECT_EQ(arena.pinned_budget_bytes(), host_memory_bytes() / 10);
}

TEST_P(ConfigBudgetsTest, ExplicitPinnedBudgetWinsAndUnlimitedMeansAllOfRam) {
  apply("tidepool.pinned_budget:64MiB");
  HostArena explicit_arena(backend(), tiering_test::test_host_options(std::size_t{96} << 20));
  EXPECT_EQ(explicit_arena.pinned_budget_bytes(), std::size_t{96} << 20);
  EXPECT_FALSE(explicit_arena.stats().budget_from_config);

  apply("tidepool.pinned_budget:unlimited");
  HostArenaOptions o;
  o.respect_memlock_limit = false;
  HostArena arena(backend(), o);
  EXPECT_EQ(arena.pinned_budget_bytes(), host_memory_bytes());
  EXPECT_TRUE(arena.stats().budget_from_config);

  // With no key the built-in quarter of RAM applies.
  apply("backend:tidepool");
  HostArena default_arena(backend(), o);
  EXPECT_EQ(default_arena.pinned_budget_bytes(), host_memory_bytes() / 4);
  EXPECT_FALSE(default_arena.stats().budget_from_config);
}

TEST_P(ConfigBudgetsTest, StoresHostArenaTakesThePinnedBudget) {
  apply("tidepool.state_budget:2MiB,tidepool.pinned_budget:32MiB");
  TieredStoreOptions o;
  o.host.respect_memlock_limit = false;
  TieredStore store(backend(), o);
  EXPECT_EQ(store.stats().host.pinned_budget_bytes, std::size_t{32} << 20);
  EXPECT_EQ(store.device_budget_bytes(), std::size_t{2} << 20);
}

INSTANTIATE_TEST_SUITE_P(Backends, ConfigBudgetsTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
