// TIDEPOOL_TEST_SEED (tests/support/test_seed.h): unset, every randomized test keeps its
// fixed seed (CI checks the same sequences each run); set, each gets another seed, the same
// for the same value, distinct across tests and values, so scripts/soak explores sequences
// and a failure it reports is replayed by its value.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <set>
#include <string>

#include "tests/support/test_seed.h"

namespace tidepool {
namespace {

// Sets TIDEPOOL_TEST_SEED for the scope and puts back what was there.
class SeedVariable {
 public:
  explicit SeedVariable(const char* value) {
    if (const char* old = std::getenv("TIDEPOOL_TEST_SEED")) old_ = old;
    if (value != nullptr) {
      setenv("TIDEPOOL_TEST_SEED", value, 1);
    } else {
      unsetenv("TIDEPOOL_TEST_SEED");
    }
  }
  ~SeedVariable() {
    if (old_) {
      setenv("TIDEPOOL_TEST_SEED", old_->c_str(), 1);
    } else {
      unsetenv("TIDEPOOL_TEST_SEED");
    }
  }
  SeedVariable(const SeedVariable&) = delete;
  SeedVariable& operator=(const SeedVariable&) = delete;

 private:
  std::optional<std::string> old_;
};

TEST(RandomSeeds, UnsetEmptyOrNotANumberKeepsTheFixedSeed) {
  for (const char* value : {static_cast<const char*>(nullptr), "", "abc", "12x", "0"}) {
    SeedVariable variable(value);
    EXPECT_EQ(test_support::seeded(12345), 12345u) << (value ? value : "(unset)");
    EXPECT_EQ(test_support::seeded(7), 7u) << (value ? value : "(unset)");
    EXPECT_NE(test_support::seed_note().find("fixed seeds"), std::string::npos);
  }
}

TEST(RandomSeeds, AValueGivesOtherSeedsTheSameEachTimeDistinctPerSiteAndValue) {
  std::set<std::uint64_t> seen;
  for (const char* value : {"1", "2", "9", "18446744073709551615"}) {
    SeedVariable variable(value);
    EXPECT_EQ(test_support::seed_note(), std::string("TIDEPOOL_TEST_SEED=") + value);
    for (std::uint64_t fixed : {0u, 1u, 7u, 12345u, 20261203u}) {
      const std::uint64_t seed = test_support::seeded(fixed);
      EXPECT_NE(seed, fixed);
      EXPECT_EQ(test_support::seeded(fixed), seed);  // replayable
      EXPECT_TRUE(seen.insert(seed).second) << "seed " << value << ", site " << fixed;
    }
  }
}

}  // namespace
}  // namespace tidepool
