// TIDEPOOL_TEST_SEED: one variable that moves every randomized test in every layer onto
// other random sequences, so a soak run (scripts/soak) explores more than the sequences CI
// checks, and a failure it finds is replayed by setting the same value. Unset or empty
// keeps each test's own fixed seed, so CI runs the same sequences every time.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>

namespace tidepool::test_support {

// The TIDEPOOL_TEST_SEED value (0 when unset, empty or not a number).
inline std::uint64_t test_seed_override() {
  const char* value = std::getenv("TIDEPOOL_TEST_SEED");
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const unsigned long long seed = std::strtoull(value, &end, 10);
  return *end == '\0' ? seed : 0;
}

// The seed for a random sequence whose fixed seed is `fixed`: `fixed` itself, or, with
// TIDEPOOL_TEST_SEED set, a mix of both (splitmix64), so each site (each thread of a test)
// still draws its own sequence and different values give unrelated ones.
inline std::uint64_t seeded(std::uint64_t fixed) {
  const std::uint64_t override_seed = test_seed_override();
  if (override_seed == 0) return fixed;
  std::uint64_t z = fixed + override_seed * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// For SCOPED_TRACE in a randomized test: how to run the failing sequence again.
inline std::string seed_note() {
  const std::uint64_t override_seed = test_seed_override();
  return override_seed == 0 ? std::string("fixed seeds (TIDEPOOL_TEST_SEED unset)")
                            : "TIDEPOOL_TEST_SEED=" + std::to_string(override_seed);
}

}  // namespace tidepool::test_support
